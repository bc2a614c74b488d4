#!/bin/sh
# Takes Stripe's published list of the addresses it sends webhooks from and writes it, with the
# date and the source, to stripe-webhook-sources.txt beside this script (the edge's
# WEBHOOK_ALLOWED_SOURCES is made from that file: its header says how).
#
#   sh stripe-webhook-sources.sh [URL [OUTPUT]]
#
# URL defaults to https://stripe.com/files/ips/ips_webhooks.txt. Every entry is checked by
# render.sh, the one place the edge checks networks; a download that is not a list of
# addresses (an error page, an empty answer) changes nothing and exits 1 with one line.

set -eu

here=$(cd "$(dirname "$0")" && pwd)
url=${1:-https://stripe.com/files/ips/ips_webhooks.txt}
output=${2:-$here/stripe-webhook-sources.txt}

fail() {
    echo "stripe sources: $*" >&2
    exit 1
}

if command -v curl >/dev/null 2>&1; then
    answer=$(curl -fsL --max-time 30 "$url") || fail "could not fetch $url"
else
    answer=$(wget -q -T 30 -O - "$url") || fail "could not fetch $url"
fi
addresses=$(printf '%s\n' "$answer" | tr -d '\r' | sed 's/#.*//; s/[[:space:]]//g' | grep -v '^$' || true)
[ -n "$addresses" ] || fail "$url answered no address"
joined=$(printf '%s\n' "$addresses" | paste -sd, -)
checked=$(env -i PATH="$PATH" APP_UPSTREAM=app:1 WEBHOOK_UPSTREAM=app:1 EDGE_LISTEN=1 \
    WEBHOOK_ALLOWED_SOURCES="$joined" sh "$here/render.sh" "$here/default.conf.template" - 2>&1 \
    >/dev/null) || fail "$url answered something that is not a list of addresses: ${checked#edge: }"

partial="$output.partial.$$"
trap 'rm -f "$partial"' EXIT
{
    echo "# The addresses Stripe sends webhook events from, one a line: WEBHOOK_ALLOWED_SOURCES for an"
    echo "# edge that takes Stripe's deliveries and no one else's:"
    echo "#   WEBHOOK_ALLOWED_SOURCES=\$(grep -v '^#' deploy/nginx/stripe-webhook-sources.txt | paste -sd, -)"
    echo "# Source: $url (Stripe's docs: https://docs.stripe.com/ips)"
    echo "# Taken: $(date -u +%Y-%m-%d)"
    echo "# Refresh: sh deploy/nginx/stripe-webhook-sources.sh (where stripe.com is reachable), then"
    echo "# render the edge again. Stripe announces changes to this list on its API announcements list."
    printf '%s\n' "$addresses"
} >"$partial"
mv "$partial" "$output"
trap - EXIT
echo "stripe sources: $(printf '%s\n' "$addresses" | wc -l | tr -d ' ') addresses from $url written to $output" >&2
