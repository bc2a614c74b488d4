"""What the payment provider sends: paid-invoice events, duplicated and shuffled, from many
concurrent senders that retry as a provider does.

The plan (``plan_build``) guarantees, for ``invoices`` invoices:

* every invoice gets an ``invoice.paid`` event; ``both_types`` of them also get an
  ``invoice.payment_succeeded`` (a distinct event id for the same payment, as Stripe sends);
* at least ``duplicate_share`` of all deliveries are re-sends of an event id already in the
  plan (the same bytes, a fresh signature each time, as a provider's retry);
* the deliveries are shuffled, so a duplicate can arrive before its original, and
  ``payment_succeeded`` before ``paid``;
* ``refused_share`` of the invoices carry a recipient in the domain the SMTP server refuses
  permanently; every other recipient is unique to its invoice, so a message maps to one
  invoice.

The senders (``Sender``): ``senders`` threads, paced to ``rate`` deliveries per second in
total. A delivery that gets anything but a 2xx (an HTTP error or a socket error) is retried
after full-jitter exponential backoff (honouring ``Retry-After`` up to a cap), at most
``max_attempts`` times. Every response is counted by status; socket failures by kind.
"""

from __future__ import annotations

import http.client
import itertools
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stack import stripe_events

PATH = "/webhooks/stripe/"


@dataclass(frozen=True)
class Delivery:
    event_id: str
    invoice_id: str
    body: bytes
    resend: bool


@dataclass(frozen=True)
class Plan:
    deliveries: list[Delivery]
    recipient_of: dict[str, str]  # provider invoice id -> recipient address (lower case)
    refused: frozenset[str]  # provider invoice ids whose recipient is refused
    both_types: int
    unique_events: int

    @property
    def invoice_of(self) -> dict[str, str]:
        return {address: invoice for invoice, address in self.recipient_of.items()}

    def describe(self) -> dict[str, Any]:
        resends = sum(d.resend for d in self.deliveries)
        return {
            "invoices": len(self.recipient_of),
            "refused_recipient_invoices": len(self.refused),
            "invoices_with_both_event_types": self.both_types,
            "unique_events": self.unique_events,
            "deliveries": len(self.deliveries),
            "duplicate_deliveries": resends,
            "duplicate_share": round(resends / len(self.deliveries), 3),
        }


def plan_build(
    *,
    invoices: int,
    rng: random.Random,
    refused_domain: str,
    both_types_share: float = 0.3,
    duplicate_share: float = 0.35,
    refused_share: float = 0.02,
) -> Plan:
    run = f"{rng.getrandbits(32):08x}"
    refused_count = max(1, round(invoices * refused_share))
    refused_indexes = set(rng.sample(range(invoices), refused_count))
    originals: list[Delivery] = []
    recipient_of: dict[str, str] = {}
    refused: set[str] = set()
    both = 0
    for i in range(invoices):
        invoice_id = f"in_chaos{run}{i:06d}"
        domain = refused_domain if i in refused_indexes else "example.com"
        recipient = f"customer{i}.{run}@{domain}"
        recipient_of[invoice_id] = recipient
        if i in refused_indexes:
            refused.add(invoice_id)
        obj = stripe_events.invoice_object(
            invoice_id=invoice_id,
            customer_email=recipient,
            customer_name=f"Customer {i}",
            amount=100 + i,
        )
        types = ["invoice.paid"]
        if rng.random() < both_types_share:
            types.append("invoice.payment_succeeded")
            both += 1
        for event_type in types:
            event = stripe_events.event(event_type, obj)
            originals.append(Delivery(event["id"], invoice_id, stripe_events.encode(event), False))
    # resends / (originals + resends) >= duplicate_share
    resends = math.ceil(len(originals) * duplicate_share / (1 - duplicate_share))
    deliveries = originals + [
        Delivery(d.event_id, d.invoice_id, d.body, True)
        for d in (rng.choice(originals) for _ in range(resends))
    ]
    rng.shuffle(deliveries)
    return Plan(
        deliveries=deliveries,
        recipient_of=recipient_of,
        refused=frozenset(refused),
        both_types=both,
        unique_events=len(originals),
    )


@dataclass
class Responses:
    """Every response and socket failure, thread-safe."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    by_status: Counter[str] = field(default_factory=Counter)
    # (time.time(), status or 0 for a socket failure), for recovery times
    log: list[tuple[float, int]] = field(default_factory=list)
    acked_events: set[str] = field(default_factory=set)
    acked_invoices: set[str] = field(default_factory=set)
    given_up: list[str] = field(default_factory=list)  # deliveries never acknowledged
    retries: int = 0
    finished: int = 0  # deliveries done (acknowledged or given up)


class Sender:
    def __init__(
        self,
        *,
        port: int = 0,
        targets: Sequence[tuple[str, int]] = (),
        secret: str,
        plan: Plan,
        senders: int,
        rate: float,
        max_attempts: int = 8,
        backoff_cap: float = 4.0,
        timeout: float = 10.0,
        seed: int = 0,
    ) -> None:
        self.port = port
        # Where to post, in turn: (address, port) of each web host, or loopback's ``port``.
        self.targets = list(targets) or [("127.0.0.1", port)]
        self._turn = itertools.count()
        self.secret = secret
        self.plan = plan
        self.senders = senders
        self.rate = rate
        self.max_attempts = max_attempts
        self.backoff_cap = backoff_cap
        self.timeout = timeout
        self.rng = random.Random(seed)  # noqa: S311 - jitter, not secrets
        self.responses = Responses()
        self._next = itertools.count()
        self._rng_lock = threading.Lock()
        self.started = 0.0
        self.ended = 0.0

    @property
    def progress(self) -> float:
        """The share of deliveries done (acknowledged or given up)."""
        return self.responses.finished / len(self.plan.deliveries)

    def run(self) -> None:
        """Send every delivery; returns when all are acknowledged or given up."""
        self.started = time.time()
        threads = [
            threading.Thread(target=self._loop, name=f"sender-{n}", daemon=True)
            for n in range(self.senders)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.ended = time.time()

    def _loop(self) -> None:
        deliveries = self.plan.deliveries
        while (index := next(self._next)) < len(deliveries):
            wait = self.started + index / self.rate - time.time()
            if wait > 0:
                time.sleep(wait)
            self._deliver(deliveries[index])

    def _jitter(self, ceiling: float) -> float:
        with self._rng_lock:
            return self.rng.uniform(0, ceiling)

    def _deliver(self, delivery: Delivery) -> None:
        record = self.responses
        for attempt in range(self.max_attempts):
            status, retry_after = self._post(delivery.body)
            with record.lock:
                record.by_status[str(status) if status else "socket_error"] += 1
                record.log.append((time.time(), status))
                if 200 <= status < 300:
                    record.acked_events.add(delivery.event_id)
                    record.acked_invoices.add(delivery.invoice_id)
                    record.finished += 1
                    return
                if attempt + 1 < self.max_attempts:
                    record.retries += 1
            backoff = self._jitter(min(self.backoff_cap, 0.25 * 2**attempt))
            time.sleep(max(backoff, min(retry_after, self.backoff_cap)))
        with record.lock:
            record.given_up.append(delivery.event_id)
            record.finished += 1

    def _post(self, body: bytes) -> tuple[int, float]:
        """One POST on a new connection: (status or 0 on a socket failure, Retry-After)."""
        host, port = self.targets[next(self._turn) % len(self.targets)]
        connection = http.client.HTTPConnection(host, port, timeout=self.timeout)
        try:
            connection.request(
                "POST",
                PATH,
                body=body,
                headers={
                    "Content-Type": "application/json",
                    "Stripe-Signature": stripe_events.signature_header(body, self.secret),
                    "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
                },
            )
            response = connection.getresponse()
            response.read()
            try:
                retry_after = float(response.getheader("Retry-After") or 0)
            except ValueError:
                retry_after = 0.0
            return response.status, retry_after
        except (OSError, http.client.HTTPException):
            return 0, 0.0
        finally:
            connection.close()
