from __future__ import annotations

import pgjobs
from sqlalchemy import text


def test_smoke(engine):
    seen = []
    job = pgjobs.TaskJob(name="smoke", run=lambda conn: seen.append(conn.execute(text("select 1")).scalar()))
    with pgjobs.Runner(engine) as runner:
        result = runner.tick(job)
    assert result.outcome == "ran", result.error
    assert seen == [1]
