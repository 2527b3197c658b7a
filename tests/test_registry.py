"""Registration in code and the import of an existing beat_schedule."""

from __future__ import annotations

from datetime import timedelta

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_leasebeat import register_schedule
from celery_leasebeat.config import LeaseBeatConfig
from celery_leasebeat.errors import InvalidCron, InvalidSchedule, UnknownTimezone
from celery_leasebeat.registry import collect_definitions, crontab_expression, registrations


@pytest.fixture
def app() -> Celery:
    app = Celery("registry-test", broker="memory://", set_as_current=False)

    @app.task(name="proj.purge", shared=False)
    def purge() -> None: ...

    return app


def test_registrations_accumulate_on_the_app_and_default_to_the_task_name(app: Celery) -> None:
    purge = app.tasks["proj.purge"]
    register_schedule(purge, "15 3 * * *", timezone="Europe/Berlin")
    register_schedule("proj.other", "*/5 * * * * *", name="other-fast", args=[1], kwargs={"x": 2}, app=app)
    found = registrations(app)
    assert set(found) == {"proj.purge", "other-fast"}
    assert found["proj.purge"].cron == "15 3 * * *" and found["proj.purge"].timezone == "Europe/Berlin"
    assert found["other-fast"].task == "proj.other" and found["other-fast"].args == [1]


def test_invalid_cron_fails_at_registration_naming_schedule_and_expression(app: Celery) -> None:
    with pytest.raises(InvalidCron, match=r"'nightly'.*'99 3 \* \* \*'"):
        register_schedule("proj.purge", "99 3 * * *", name="nightly", app=app)
    assert "nightly" not in registrations(app)


def test_unknown_zone_fails_at_registration(app: Celery) -> None:
    with pytest.raises(UnknownTimezone, match="'nightly'.*'Europe/Nowhere'"):
        register_schedule("proj.purge", "0 3 * * *", name="nightly", timezone="Europe/Nowhere", app=app)


def test_beat_schedule_entries_of_every_supported_type(app: Celery) -> None:
    app.conf.timezone = "Europe/Berlin"
    app.conf.beat_schedule = {
        "seconds": {"task": "proj.purge", "schedule": 30.0},
        "delta": {"task": "proj.purge", "schedule": timedelta(minutes=2), "args": (1,)},
        "celery-schedule": {"task": "proj.purge", "schedule": schedule(run_every=45)},
        "friday-13th": {"task": "proj.purge", "schedule": crontab(minute=0, hour=9, day_of_month=13, day_of_week=5)},
        "with-options": {"task": "proj.purge", "schedule": 10, "options": {"queue": "slow", "expires": 30}},
    }
    found = {d.name: d for d in collect_definitions(app, LeaseBeatConfig())}
    assert found["seconds"].kind == "interval" and found["seconds"].interval_seconds == 30
    assert found["delta"].interval_seconds == 120 and found["delta"].args == [1]
    assert found["celery-schedule"].interval_seconds == 45
    friday = found["friday-13th"]
    assert (friday.kind, friday.cron, friday.timezone) == ("crontab", "0 9 13 * 5", "Europe/Berlin")
    assert friday.spec().day_or is False  # type: ignore[union-attr]
    assert found["with-options"].options == {"queue": "slow", "expires": 30}


def test_celery_default_backend_cleanup_is_served(app: Celery) -> None:
    app.conf.result_expires = 3600
    app.conf.result_backend = "db+sqlite://"  # no auto-expiry: Celery installs the cleanup
    found = {d.name: d for d in collect_definitions(app, LeaseBeatConfig())}
    assert found["celery.backend_cleanup"].cron == "0 4 * * *"
    assert found["celery.backend_cleanup"].options == {"expires": 12 * 3600}


def test_crontab_keeps_star_and_steps() -> None:
    assert crontab_expression(crontab()) == "* * * * *"
    assert crontab_expression(crontab(minute="*/15", hour="*/2")) == "*/15 */2 * * *"
    assert crontab_expression(crontab(minute="0,30", hour="8-10", day_of_week="mon-fri")) == "0,30 8,9,10 * * 1,2,3,4,5"


def test_an_entry_that_cannot_be_served_is_named(app: Celery) -> None:
    class BusinessDays(schedule):  # a custom schedule class: its is_due logic cannot be stored
        pass

    app.conf.beat_schedule = {"weekdays": {"task": "proj.purge", "schedule": BusinessDays(run_every=60)}}
    with pytest.raises(InvalidSchedule, match="'weekdays'.*BusinessDays"):
        collect_definitions(app, LeaseBeatConfig())


def test_configured_override_applies_and_a_missing_cron_is_an_error(app: Celery) -> None:
    register_schedule("proj.purge", None, name="needs-override", app=app)
    with pytest.raises(InvalidSchedule, match="'needs-override' has no cron expression"):
        collect_definitions(app, LeaseBeatConfig())
    found = collect_definitions(app, LeaseBeatConfig(overrides={"needs-override": "0 6 * * *"}))
    assert {d.name: d.cron for d in found}["needs-override"] == "0 6 * * *"


def test_non_json_arguments_are_refused_naming_the_schedule(app: Celery) -> None:
    with pytest.raises(InvalidSchedule, match="'odd'.*args"):
        register_schedule("proj.purge", "* * * * *", name="odd", args=[object()], app=app)


def test_schedules_kept_as_code_in_a_toml_file(app: Celery, tmp_path) -> None:  # type: ignore[no-untyped-def]
    schedule_file = tmp_path / "leasebeat.toml"
    schedule_file.write_text(
        """
[schedules.nightly-purge]
task = "proj.purge"
cron = "15 3 * * *"
timezone = "Europe/Berlin"
grace = 600

[schedules.every-ten]
task = "proj.purge"
every = 10
queue = "batch"

[schedules.rollup]
task = "proj.purge"
after = "nightly-purge"
"""
    )
    found = {d.name: d for d in collect_definitions(app, LeaseBeatConfig(schedule_file=str(schedule_file)))}
    assert found["nightly-purge"].cron == "15 3 * * *" and found["nightly-purge"].grace_seconds == 600
    assert found["every-ten"].interval_seconds == 10 and found["every-ten"].options == {"queue": "batch"}
    assert found["rollup"].kind == "triggered" and found["rollup"].after == "nightly-purge"


def test_a_bad_schedule_file_is_named_with_the_schedule(app: Celery, tmp_path) -> None:  # type: ignore[no-untyped-def]
    schedule_file = tmp_path / "leasebeat.toml"
    schedule_file.write_text('[schedules.typo]\ntask = "proj.purge"\ncron = "61 * * * *"\ncolour = "red"\n')
    with pytest.raises(InvalidSchedule, match=r"leasebeat.toml: schedule 'typo': unknown key\(s\) colour"):
        collect_definitions(app, LeaseBeatConfig(schedule_file=str(schedule_file)))
    schedule_file.write_text('[schedules.typo]\ntask = "proj.purge"\ncron = "61 * * * *"\n')
    with pytest.raises(InvalidSchedule, match=r"leasebeat.toml: schedule 'typo': invalid cron expression '61"):
        collect_definitions(app, LeaseBeatConfig(schedule_file=str(schedule_file)))
    with pytest.raises(InvalidSchedule, match="cannot be read"):
        collect_definitions(app, LeaseBeatConfig(schedule_file=str(tmp_path / "missing.toml")))
