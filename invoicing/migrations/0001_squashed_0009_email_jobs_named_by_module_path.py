"""The invoices' and emails' tables as they stand, in place of invoicing's earlier migrations.
Upgrading: CHANGELOG.md, "Upgrading a database migrated before one migration per app"."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    replaces = [
        ("invoicing", "0001_initial"),
        ("invoicing", "0001_squashed_0005_dead_letter_failures_worded"),
        ("invoicing", "0002_email_delivery_pending"),
        ("invoicing", "0003_recipient_override_and_powers"),
        ("invoicing", "0004_email_delivery_sending_index"),
        ("invoicing", "0005_dead_letter_failures_worded"),
        ("invoicing", "0006_invoice_provider_customer_id"),
        ("invoicing", "0007_email_delivery_recipient_and_bounce"),
        ("invoicing", "0008_email_delivery_provider_message_id"),
        ("invoicing", "0009_email_jobs_named_by_module_path"),
    ]

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Invoice",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("provider_invoice_id", models.CharField(max_length=255, unique=True)),
                ("number", models.CharField(blank=True, max_length=255)),
                ("customer_email", models.CharField(blank=True, max_length=320)),
                ("provider_customer_id", models.CharField(blank=True, max_length=255)),
                ("recipient_override", models.EmailField(blank=True, max_length=320)),
                ("customer_name", models.CharField(blank=True, max_length=255)),
                (
                    "amount_paid",
                    models.BigIntegerField(default=0, help_text="Integer minor units."),
                ),
                ("currency", models.CharField(blank=True, max_length=3)),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("draft", "Draft"),
                            ("open", "Open"),
                            ("paid", "Paid"),
                            ("uncollectible", "Uncollectible"),
                            ("void", "Void"),
                        ],
                        default="open",
                        max_length=20,
                    ),
                ),
                ("hosted_invoice_url", models.URLField(blank=True, max_length=2000)),
                ("paid_at", models.DateTimeField(blank=True, null=True)),
                ("provider_updated_at", models.DateTimeField()),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("updated_at", models.DateTimeField(auto_now=True)),
            ],
            options={
                "permissions": [
                    ("resend_invoice_email", "Can resend invoice email"),
                    ("correct_invoice_recipient", "Can correct invoice recipient"),
                ],
                "indexes": [
                    models.Index(fields=["status", "paid_at"], name="invoice_status_paid_idx")
                ],
            },
        ),
        migrations.CreateModel(
            name="EmailDelivery",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("key", models.CharField(max_length=255, unique=True)),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("pending", "Pending (requested, not yet claimed)"),
                            ("sending", "Sending"),
                            ("sent", "Sent"),
                            ("failed", "Failed"),
                            ("bounced", "Bounced (the provider reported it undelivered)"),
                        ],
                        max_length=10,
                    ),
                ),
                ("attempts", models.PositiveIntegerField(default=0)),
                ("claimed_by", models.CharField(blank=True, max_length=255)),
                ("lease_expires_at", models.DateTimeField(blank=True, null=True)),
                ("message_id", models.CharField(max_length=255)),
                ("sent_at", models.DateTimeField(blank=True, null=True)),
                (
                    "recipient",
                    models.CharField(
                        blank=True,
                        help_text="The address its last attempt was for.",
                        max_length=320,
                    ),
                ),
                ("provider_message_id", models.CharField(blank=True, max_length=255)),
                ("bounced_at", models.DateTimeField(blank=True, null=True)),
                ("last_error", models.TextField(blank=True)),
                ("requested_by", models.CharField(blank=True, max_length=150)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("updated_at", models.DateTimeField(auto_now=True)),
                (
                    "invoice",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="emails",
                        to="invoicing.invoice",
                    ),
                ),
            ],
            options={
                "verbose_name_plural": "email deliveries",
                "indexes": [
                    models.Index(
                        condition=models.Q(("state", "sending")),
                        fields=["updated_at"],
                        name="emaildelivery_sending_idx",
                    )
                ],
            },
        ),
    ]
