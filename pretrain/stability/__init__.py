"""Surviving a long run (docs/stability.md).

* guard.py - the loss-spike and non-finite guard; recovery.py - which checkpoint a rollback returns to.
* preemption.py - SIGUSR1/SIGTERM -> save and exit for requeue; watchdog.py - hang detection.
* lifetime.py - run-directory lock, dying with the launcher; faults.py - fault drills (`fault.*`).
"""
