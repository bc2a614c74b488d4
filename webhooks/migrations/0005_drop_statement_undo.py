"""Drop ``webhooks_statement_undo(reason)``: nothing calls it. Reversed, it is created again as
0004 created it."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("webhooks", "0004_statement_undo"),
    ]

    operations = [
        migrations.RunSQL(
            sql="DROP FUNCTION IF EXISTS webhooks_statement_undo(text)",
            reverse_sql="""
CREATE FUNCTION webhooks_statement_undo(reason text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'serialization_failure', MESSAGE = reason;
END
$$
""",
        ),
    ]
