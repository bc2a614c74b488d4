from django.db import models


class Guest(models.Model):
    name = models.CharField(max_length=100, unique=True)
    greeted = models.PositiveIntegerField(default=0)  # how often: a second greeting is a bug
    failures_left = models.PositiveIntegerField(default=0)  # transient failures to raise first

    def __str__(self) -> str:
        return self.name
