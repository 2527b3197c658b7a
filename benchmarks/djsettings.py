"""Django settings for django-celery-beat under benchmark."""

import os
from urllib.parse import urlparse

_url = urlparse(os.environ.get("BENCH_DJANGO_DATABASE", "postgresql://postgres@127.0.0.1:5432/lbbench_django"))
SECRET_KEY = "benchmark-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": _url.username or "postgres",
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": str(_url.port or 5432),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
