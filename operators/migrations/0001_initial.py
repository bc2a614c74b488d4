"""The audit trail's model, moved here from ``core`` as ``asyncwork.0001`` moves the machinery's:
state created here, table renamed (``core_operatoraction`` -> ``operators_operatoraction``),
content type relabelled; ``core.0006`` forgets the old state."""

import django.db.models.deletion
from django.db import migrations, models

MODELS = ("operatoraction",)


def _tables(old: str, new: str) -> list[str]:
    return [f"ALTER TABLE {old}_{m} RENAME TO {new}_{m}" for m in MODELS]


def _content_types_move(old: str, new: str):
    """Relabel the models' content types, so the permissions that hang on them (and the
    groups holding those), admin log entries and generic foreign keys follow the models. A
    fresh database has none yet: they are created after migrate, under the new label."""

    def move(apps, schema_editor):
        ContentType = apps.get_model("contenttypes", "ContentType")
        taken = set(
            ContentType.objects.filter(app_label=new, model__in=MODELS).values_list(
                "model", flat=True
            )
        )
        ContentType.objects.filter(app_label=old, model__in=set(MODELS) - taken).update(
            app_label=new
        )

    return move


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        # The tables exist already, made by core's migrations; they move here.
        ("core", "0005_lockholder"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="OperatorAction",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("action", models.CharField(db_index=True, max_length=100)),
                        ("actor", models.CharField(db_index=True, max_length=150)),
                        ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                        ("target_id", models.CharField(blank=True, max_length=64)),
                        ("target_label", models.CharField(blank=True, max_length=255)),
                        ("before", models.JSONField(blank=True, null=True)),
                        ("after", models.JSONField(blank=True, null=True)),
                        ("detail", models.CharField(blank=True, max_length=500)),
                        (
                            "target_type",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to="contenttypes.contenttype",
                            ),
                        ),
                    ],
                    options={
                        "indexes": [
                            models.Index(
                                fields=["target_type", "target_id"],
                                name="operatoraction_target_idx",
                            )
                        ],
                    },
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    sql=_tables("core", "operators"), reverse_sql=_tables("operators", "core")
                ),
                migrations.RunPython(
                    _content_types_move("core", "operators"),
                    _content_types_move("operators", "core"),
                ),
            ],
        ),
    ]
