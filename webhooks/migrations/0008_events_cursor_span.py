"""The span the reconcile's cursor covers (``covered_from``) and the oldest time a walk lists
(``walk_since``). A walk under way without one starts again; a cursor without ``covered_from``
gets it when its next walk ends."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("webhooks", "0007_events_reconcile"),
    ]

    operations = [
        migrations.AddField(
            model_name="eventscursor",
            name="covered_from",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="eventscursor",
            name="walk_since",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
