from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("invoicing", "0005_dead_letter_failures_worded"),
    ]

    operations = [
        migrations.AddField(
            model_name="invoice",
            name="provider_customer_id",
            field=models.CharField(blank=True, max_length=255),
        ),
    ]
