"""``webhooks_statement_undo(reason)``: raises ``serialization_failure`` (40001), undoing the
statement that calls it. The one statement that stores an event and applies it
(``webhooks.services``) calls it when its snapshot cannot settle the event; the event is then
recorded in a transaction instead."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("webhooks", "0003_reprocess_power"),
    ]

    operations = [
        migrations.RunSQL(
            sql="""
CREATE FUNCTION webhooks_statement_undo(reason text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'serialization_failure', MESSAGE = reason;
END
$$
""",
            reverse_sql="DROP FUNCTION webhooks_statement_undo(text)",
        ),
    ]
