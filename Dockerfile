# The image compose.yaml builds: celery-leasebeat with PostgreSQL, Redis and Flower support,
# and the example project in /app.
FROM python:3.12-slim
COPY . /src
RUN pip install --no-cache-dir "/src[postgres,redis]" "flower>=2.0"
WORKDIR /app
COPY examples/proj.py /app/proj.py
ENV PYTHONUNBUFFERED=1
