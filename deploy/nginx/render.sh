#!/bin/sh
# Renders the edge's nginx configuration (default.conf.template) from the environment: the one
# way it is produced, by compose.yaml's edge service, stack/nginx.py and the tests.
#
#   sh render.sh [TEMPLATE [OUTPUT]]   OUTPUT "-" is standard output
#   sh render.sh --settings            the settings it reads, one per line
#
# TEMPLATE defaults to default.conf.template beside this script, OUTPUT to
# /etc/nginx/conf.d/default.conf (where the nginx image's nginx.conf includes it). Plain POSIX
# sh and awk, as in the nginx:alpine image (busybox) and on Debian (dash, mawk).
#
# Every setting is checked before anything is written: a bad value stops start-up with a
# message naming it, rather than an nginx error about a line the operator never wrote, or a
# config that silently means something else (a mistyped allow-list entry must not open the
# webhook to everyone). Values cannot smuggle nginx syntax in: numbers are digits, networks
# are addresses, and the host settings refuse spaces, quotes, braces and semicolons.
#
# Settings (empty counts as unset):
#   APP_UPSTREAM                 required: host:port of the gunicorn serving every path but
#                                the webhook
#   WEBHOOK_UPSTREAM             required: host:port of the gunicorn serving the webhook alone
#   EDGE_LISTEN                  required: the public port, or address:port
#   WEBHOOK_ALLOWED_SOURCES      required: comma-separated networks that may post webhooks
#                                (CIDRs or addresses; stripe-webhook-sources.txt beside this
#                                script lists Stripe's), or "any"; anyone else gets 403
#   EDGE_CAPACITY_LISTEN         127.0.0.1:8081: the internal capacity hop (see the template);
#                                keep it on loopback, nothing else should reach it
#   EDGE_ADDRESS_RATE            20: requests per second one client may make, on any path
#                                without a limit of its own
#   EDGE_ADDRESS_BURST           40: how many above that rate at once (a page and its files)
#   EDGE_ADDRESS_CONNECTIONS     10: requests one client may have in progress at once
#   WEBHOOK_EDGE_RATE            50: webhooks per second admitted in all (the capacity)
#   WEBHOOK_EDGE_BURST           10: how many above that rate at once
#   WEBHOOK_EDGE_CONNECTIONS     6: webhooks in flight to gunicorn at once (2 per worker)
#   WEBHOOK_EDGE_ADDRESS_RATE    a quarter of the rate, rounded up: webhooks per second per
#                                client, its share of the capacity
#   WEBHOOK_EDGE_ADDRESS_BURST   12: how many above that rate one client may send before 429;
#                                they wait their turn at its rate (the template's header
#                                derives this number)
#   WEBHOOK_EDGE_ADDRESS_CONNECTIONS  the connections: webhooks one client may have in progress
#                                at once
#   EDGE_TRUSTED_PROXIES         empty (none): comma-separated networks of proxies in front of
#                                the edge whose X-Forwarded-For names the client and whose
#                                X-Forwarded-Proto says the scheme
#   EDGE_METRICS_SOURCES         empty (none): networks that may fetch /metrics through the
#                                edge; everyone else gets 404
#   WEBHOOK_MAX_BODY_BYTES       1048576: larger webhook bodies get 413 (the app's default)
#   EDGE_HEADER_TIMEOUT          5: seconds for a client to send its request headers
#   EDGE_BODY_TIMEOUT            5: seconds a client may pause while sending its body (and
#                                while reading the response)
#   EDGE_KEEPALIVE_TIMEOUT       5: seconds an idle connection is kept open; behind a load
#                                balancer, longer than the balancer's own idle timeout
#   EDGE_HEALTH_RATE             2: GET /health/ per second per client
#   EDGE_HEALTH_BURST            10: how many above that rate at once
#   EDGE_LOGIN_RATE              10: requests to /admin/login/ per minute per client
#   EDGE_LOGIN_BURST             5: how many above that rate at once
#   EDGE_ACCESS_LOG              /var/log/nginx/access.log: the access log (the nginx image's
#                                standard output); no query strings, no Referer

set -eu

SETTINGS="APP_UPSTREAM WEBHOOK_UPSTREAM EDGE_LISTEN WEBHOOK_ALLOWED_SOURCES EDGE_CAPACITY_LISTEN
EDGE_ADDRESS_RATE EDGE_ADDRESS_BURST EDGE_ADDRESS_CONNECTIONS WEBHOOK_EDGE_RATE WEBHOOK_EDGE_BURST
WEBHOOK_EDGE_CONNECTIONS WEBHOOK_EDGE_ADDRESS_RATE WEBHOOK_EDGE_ADDRESS_BURST
WEBHOOK_EDGE_ADDRESS_CONNECTIONS EDGE_TRUSTED_PROXIES EDGE_METRICS_SOURCES WEBHOOK_MAX_BODY_BYTES
EDGE_HEADER_TIMEOUT EDGE_BODY_TIMEOUT EDGE_KEEPALIVE_TIMEOUT EDGE_HEALTH_RATE EDGE_HEALTH_BURST
EDGE_LOGIN_RATE EDGE_LOGIN_BURST EDGE_ACCESS_LOG"
# Filled in by this script, not set by the operator.
DERIVED="EDGE_LOGIN_RETRY_AFTER EDGE_TRUSTED_PROXIES_GEO WEBHOOK_EDGE_ARRIVAL_BURST"

if [ "${1:-}" = "--settings" ]; then
    for name in $SETTINGS; do echo "$name"; done
    exit 0
fi

here=$(cd "$(dirname "$0")" && pwd)
template=${1:-$here/default.conf.template}
output=${2:-/etc/nginx/conf.d/default.conf}

fail() {
    echo "edge: $*" >&2
    exit 1
}

# --- checks ---------------------------------------------------------------------------------

is_count() {  # a decimal integer of at most 9 digits (no sign, no overflow in $(( )))
    case $1 in '' | *[!0-9]*) return 1 ;; esac
    [ ${#1} -le 9 ]
}

count() {  # count NAME VALUE [MINIMUM]: VALUE is an integer >= MINIMUM (default 1)
    is_count "$2" && [ "$2" -ge "${3:-1}" ] ||
        fail "$1 must be a whole number of at least ${3:-1} (got '$2')"
}

not_above() {  # not_above NAME VALUE OF_NAME OF_VALUE: one address's share of a budget
    [ "$2" -le "$4" ] || fail "$1 ($2) is above $3 ($4): one address could take it all"
}

is_ipv4() {
    case $1 in '' | *[!0-9.]* | .* | *. | *..*) return 1 ;; esac
    ipv4_ifs=$IFS
    IFS=.
    # shellcheck disable=SC2086  # split on the dots on purpose; only digits and dots remain
    set -- $1
    IFS=$ipv4_ifs
    [ $# -eq 4 ] || return 1
    for octet in "$@"; do
        [ ${#octet} -le 3 ] && [ "$octet" -le 255 ] || return 1
    done
}

is_ipv6() {
    case $1 in *:*) ;; *) return 1 ;; esac
    case $1 in *[!0-9A-Fa-f:.]* | *:::* | :[!:]* | *[!:]:) return 1 ;; esac
    case ${1#*::} in *::*) return 1 ;; esac  # "::" at most once
    case $1 in *::*) ipv6_most=7 ;; *) ipv6_most=8 ;; esac
    ipv6_address=$1
    ipv6_groups=0
    ipv6_ifs=$IFS
    IFS=:
    # shellcheck disable=SC2086  # split on the colons on purpose; only hex, colons, dots remain
    set -- $1
    IFS=$ipv6_ifs
    for group in "$@"; do
        case $group in
            '') ;;
            *.*)  # an IPv4 tail (::ffff:192.0.2.1): last, and worth two groups
                case $ipv6_address in *":$group") ;; *) return 1 ;; esac
                is_ipv4 "$group" || return 1
                ipv6_groups=$((ipv6_groups + 2)) ;;
            *)
                [ ${#group} -le 4 ] || return 1
                ipv6_groups=$((ipv6_groups + 1)) ;;
        esac
    done
    if [ "$ipv6_most" -eq 8 ]; then [ "$ipv6_groups" -eq 8 ]; else [ "$ipv6_groups" -le 7 ]; fi
}

is_network() {  # an IPv4 or IPv6 address, with or without a /prefix length
    case $1 in
        */*) network_address=${1%/*} network_bits=${1#*/} ;;
        *) network_address=$1 network_bits=none ;;
    esac
    if is_ipv4 "$network_address"; then network_max=32
    elif is_ipv6 "$network_address"; then network_max=128
    else return 1
    fi
    [ "$network_bits" = none ] ||
        { is_count "$network_bits" && [ "$network_bits" -le "$network_max" ]; }
}

networks() {  # networks NAME VALUE: the comma-separated list, one checked network a line
    networks_name=$1
    networks_value=$2
    [ -n "$(printf '%s' "$networks_value" | tr -d ' \t\r\n')" ] || return 0  # blank: none
    networks_ifs=$IFS
    IFS=,
    set -f
    # shellcheck disable=SC2086  # split on the commas on purpose, without globbing
    set -- $networks_value
    set +f
    IFS=$networks_ifs
    for raw in "$@"; do
        entry=$(printf '%s' "$raw" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//')
        [ -n "$entry" ] || fail "$networks_name has an empty entry: '$networks_value'"
        is_network "$entry" || fail "$networks_name: '$raw' is not a network" \
            "(expected an address or a CIDR such as 203.0.113.0/24 or 2001:db8::/32)"
        echo "$entry"
    done
}

host_port() {  # host_port NAME VALUE: one word nginx reads as a port, host:port or [v6]:port
    # \133 \135 are [ and ]; anything else left over could be nginx syntax.
    [ -z "$(printf '%s' "$2" | tr -d 'A-Za-z0-9.:_\133\135-')" ] ||
        fail "$1 must be a port, host:port or address:port (got '$2')"
}

# --- settings -------------------------------------------------------------------------------

# ":=" also replaces an empty value: empty and unset are the same.
: "${APP_UPSTREAM:=}" "${WEBHOOK_UPSTREAM:=}" "${EDGE_LISTEN:=}"
: "${EDGE_CAPACITY_LISTEN:=127.0.0.1:8081}"
[ -n "$APP_UPSTREAM" ] || fail "APP_UPSTREAM is required (host:port of the gunicorn serving" \
    "every path but the webhook)"
[ -n "$WEBHOOK_UPSTREAM" ] || fail "WEBHOOK_UPSTREAM is required (host:port of the gunicorn" \
    "serving the webhook alone)"
[ -n "$EDGE_LISTEN" ] || fail "EDGE_LISTEN is required (the port to listen on)"
host_port APP_UPSTREAM "$APP_UPSTREAM"
host_port WEBHOOK_UPSTREAM "$WEBHOOK_UPSTREAM"
host_port EDGE_LISTEN "$EDGE_LISTEN"
host_port EDGE_CAPACITY_LISTEN "$EDGE_CAPACITY_LISTEN"

: "${EDGE_ADDRESS_RATE:=20}" "${EDGE_ADDRESS_BURST:=40}" "${EDGE_ADDRESS_CONNECTIONS:=10}"
count EDGE_ADDRESS_RATE "$EDGE_ADDRESS_RATE"
count EDGE_ADDRESS_BURST "$EDGE_ADDRESS_BURST"
count EDGE_ADDRESS_CONNECTIONS "$EDGE_ADDRESS_CONNECTIONS"

: "${WEBHOOK_EDGE_RATE:=50}" "${WEBHOOK_EDGE_BURST:=10}" "${WEBHOOK_EDGE_CONNECTIONS:=6}"
count WEBHOOK_EDGE_RATE "$WEBHOOK_EDGE_RATE"
count WEBHOOK_EDGE_BURST "$WEBHOOK_EDGE_BURST"
count WEBHOOK_EDGE_CONNECTIONS "$WEBHOOK_EDGE_CONNECTIONS"
# One address's budget; the template's header derives each number. Its rate is its share: a
# quarter of the capacity, so senders flooding from up to three allowed addresses still leave a
# quarter to everyone else; a provider sending from several addresses, as Stripe does, still
# gets the whole rate. Its burst waits its turn at that rate, and it may have as many requests in
# flight as the capacity server allows in all.
: "${WEBHOOK_EDGE_ADDRESS_RATE:=$(((WEBHOOK_EDGE_RATE + 3) / 4))}"
: "${WEBHOOK_EDGE_ADDRESS_BURST:=12}"
: "${WEBHOOK_EDGE_ADDRESS_CONNECTIONS:=$WEBHOOK_EDGE_CONNECTIONS}"
count WEBHOOK_EDGE_ADDRESS_RATE "$WEBHOOK_EDGE_ADDRESS_RATE"
count WEBHOOK_EDGE_ADDRESS_BURST "$WEBHOOK_EDGE_ADDRESS_BURST"
count WEBHOOK_EDGE_ADDRESS_CONNECTIONS "$WEBHOOK_EDGE_ADDRESS_CONNECTIONS"
not_above WEBHOOK_EDGE_ADDRESS_RATE "$WEBHOOK_EDGE_ADDRESS_RATE" \
    WEBHOOK_EDGE_RATE "$WEBHOOK_EDGE_RATE"
not_above WEBHOOK_EDGE_ADDRESS_CONNECTIONS "$WEBHOOK_EDGE_ADDRESS_CONNECTIONS" \
    WEBHOOK_EDGE_CONNECTIONS "$WEBHOOK_EDGE_CONNECTIONS"
# The capacity's rate judged on arrival: its burst holds one address's whole burst and the
# capacity's own (the template's header).
# shellcheck disable=SC2034  # reaches awk through the environment, exported below
WEBHOOK_EDGE_ARRIVAL_BURST=$((WEBHOOK_EDGE_BURST + WEBHOOK_EDGE_ADDRESS_BURST))

: "${WEBHOOK_MAX_BODY_BYTES:=1048576}" "${EDGE_HEADER_TIMEOUT:=5}" "${EDGE_BODY_TIMEOUT:=5}"
: "${EDGE_KEEPALIVE_TIMEOUT:=5}"
count WEBHOOK_MAX_BODY_BYTES "$WEBHOOK_MAX_BODY_BYTES"
count EDGE_HEADER_TIMEOUT "$EDGE_HEADER_TIMEOUT"
count EDGE_BODY_TIMEOUT "$EDGE_BODY_TIMEOUT"
count EDGE_KEEPALIVE_TIMEOUT "$EDGE_KEEPALIVE_TIMEOUT"
: "${EDGE_HEALTH_RATE:=2}" "${EDGE_HEALTH_BURST:=10}"
: "${EDGE_LOGIN_RATE:=10}" "${EDGE_LOGIN_BURST:=5}"
count EDGE_HEALTH_RATE "$EDGE_HEALTH_RATE"
count EDGE_HEALTH_BURST "$EDGE_HEALTH_BURST"
count EDGE_LOGIN_RATE "$EDGE_LOGIN_RATE"
count EDGE_LOGIN_BURST "$EDGE_LOGIN_BURST"
# shellcheck disable=SC2034  # reaches awk through the environment, exported below
EDGE_LOGIN_RETRY_AFTER=$(((60 + EDGE_LOGIN_RATE - 1) / EDGE_LOGIN_RATE))

# Who may post webhooks is a decision, never a default: the networks, or "any".
: "${WEBHOOK_ALLOWED_SOURCES:=}"
case $(printf '%s' "$WEBHOOK_ALLOWED_SOURCES" | tr -d ' \t\r\n') in
    '') fail "WEBHOOK_ALLOWED_SOURCES is required: the networks that may post webhooks" \
        "(Stripe's are in deploy/nginx/stripe-webhook-sources.txt), or 'any'" ;;
    any) WEBHOOK_ALLOWED_SOURCES="default 1;  # WEBHOOK_ALLOWED_SOURCES=any: every address" ;;
    *)
        # A plain assignment, so that a refused entry stops the script (set -e).
        sources=$(networks WEBHOOK_ALLOWED_SOURCES "$WEBHOOK_ALLOWED_SOURCES")
        WEBHOOK_ALLOWED_SOURCES="default 0;
$(printf '%s\n' "$sources" | sed 's/$/ 1;/')" ;;
esac

# The lists become lines of nginx configuration (geo entries, a set_real_ip_from each).
: "${EDGE_TRUSTED_PROXIES:=}" "${EDGE_METRICS_SOURCES:=}"
proxies=$(networks EDGE_TRUSTED_PROXIES "$EDGE_TRUSTED_PROXIES")
if [ -z "$proxies" ]; then
    EDGE_TRUSTED_PROXIES="# EDGE_TRUSTED_PROXIES is empty: the client is the connection's address"
    EDGE_TRUSTED_PROXIES_GEO="default 0;  # EDGE_TRUSTED_PROXIES is empty"
else
    EDGE_TRUSTED_PROXIES="$(printf '%s\n' "$proxies" | sed 's/^/set_real_ip_from /; s/$/;/')
real_ip_header X-Forwarded-For;
real_ip_recursive on;"
    EDGE_TRUSTED_PROXIES_GEO="default 0;
$(printf '%s\n' "$proxies" | sed 's/$/ 1;/')"
fi
metrics=$(networks EDGE_METRICS_SOURCES "$EDGE_METRICS_SOURCES")
if [ -z "$metrics" ]; then
    EDGE_METRICS_SOURCES="default 0;  # EDGE_METRICS_SOURCES is empty: /metrics is 404 for all"
else
    EDGE_METRICS_SOURCES="default 0;
$(printf '%s\n' "$metrics" | sed 's/$/ 1;/')"
fi

: "${EDGE_ACCESS_LOG:=/var/log/nginx/access.log}"
case $EDGE_ACCESS_LOG in
    /*) ;;
    *) fail "EDGE_ACCESS_LOG must be an absolute path (got '$EDGE_ACCESS_LOG')" ;;
esac
[ -z "$(printf '%s' "$EDGE_ACCESS_LOG" | tr -d 'A-Za-z0-9._/-')" ] ||
    fail "EDGE_ACCESS_LOG may hold letters, digits, '.', '_', '-' and '/' only" \
        "(got '$EDGE_ACCESS_LOG')"

# --- render ---------------------------------------------------------------------------------

[ -f "$template" ] || fail "no template at $template"
# shellcheck disable=SC2086,SC2163  # the names, each a single word, not the lists' values
export $SETTINGS $DERIVED

# Only ${NAME} with an upper-case name is a setting; nginx's own $variables are left alone. A
# placeholder alone on its line indents every line of a multi-line value as it is indented.
render() {
    # shellcheck disable=SC2086,SC2116  # echo joins the names with single spaces
    awk -v names="$(echo $SETTINGS $DERIVED)" '
        BEGIN {
            split(names, list, " ")
            for (i in list) known[list[i]] = 1
        }
        {
            line = $0
            if (line ~ /^[ \t]*\$\{[A-Z][A-Z0-9_]*\}[ \t]*$/) {
                indent = line
                sub(/\$.*/, "", indent)
                name = line
                sub(/^[ \t]*\$\{/, "", name)
                sub(/\}[ \t]*$/, "", name)
                if (!(name in known)) unknown(name)
                count = split(ENVIRON[name], parts, "\n")
                for (i = 1; i <= count; i++) print indent parts[i]
                next
            }
            out = ""
            while ((start = index(line, "${")) > 0) {
                rest = substr(line, start + 2)
                end = index(rest, "}")
                name = substr(rest, 1, end - 1)
                if (end == 0 || name !~ /^[A-Z][A-Z0-9_]*$/) {
                    out = out substr(line, 1, start + 1)
                    line = rest
                    continue
                }
                if (!(name in known)) unknown(name)
                out = out substr(line, 1, start - 1) ENVIRON[name]
                line = substr(rest, end + 1)
            }
            print out line
        }
        function unknown(name) {
            print "edge: the template names ${" name "}, which is not a setting" > "/dev/stderr"
            exit 1
        }
    ' "$template"
}

if [ "$output" = "-" ]; then
    render
else
    # Written beside the target and moved into place: a failed render leaves no half file.
    partial="$output.partial.$$"
    trap 'rm -f "$partial"' EXIT
    render >"$partial"
    mv "$partial" "$output"
    trap - EXIT
    echo "edge: rendered $output" >&2
fi
