"""Benchmarks of leasebeat against Celery's scheduler, django-celery-beat and RedBeat.

Run ``python -m benchmarks --help``; see docs/benchmarks/README.md.
"""
