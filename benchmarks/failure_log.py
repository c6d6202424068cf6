"""A pytest plugin for `make gpu-check`: `-p benchmarks.failure_log --failure-log PATH` appends each failure's
traceback to PATH as it happens. pytest prints tracebacks only in its closing summary, which a run killed at the
check's budget never writes (the H200 run of 2026-12-04 lost the int8 failures' causes so). Under xdist the
controller writes, for its workers' reports too, a worker's crash included."""
from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption("--failure-log", default=None, help="append each failure's traceback here as it happens")


def pytest_configure(config):
    path = config.getoption("failure_log")
    if path and not hasattr(config, "workerinput"):  # an xdist worker's reports reach the controller's hook
        config.pluginmanager.register(FailureWriter(path), "failure-writer")


class FailureWriter:
    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.failed:
            with open(self.path, "a") as sink:
                sink.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
