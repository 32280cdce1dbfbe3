import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("blog", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="PostCounts",
            fields=[
                (
                    "author",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        serialize=False,
                        to="blog.author",
                    ),
                ),
                ("posts", models.IntegerField()),
                ("words", models.IntegerField()),
            ],
            options={
                "verbose_name_plural": "post counts",
                "db_table": "post_counts",
            },
        ),
    ]
