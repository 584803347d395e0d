"""Reading a pipeline run's report in tests."""


def statuses(report) -> dict[str, str]:
    """{stage: ran | cached | resumed | failed | ...} of a `PipelineReport`."""
    return {s.name: s.status for s in report.stages}
