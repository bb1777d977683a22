"""Background cells (jobs) against a real server: they return at once, keep every output (also
across a lost connection), queue the next cells behind them, and end as asked."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import plain, run, start_server, stdout_of, wait_until
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import genie_core
from genie_core.client import Job, Request
from genie_core.errors import ConnectionLost, RemoteError
from genie_core.protocol import Message, MessageType

STEPS = "import time\nfor i in range({n}):\n    print('step', i, flush=True)\n    time.sleep({pause})\n"


def test_a_job_returns_at_once_and_the_next_cell_runs_after_it(client):
    job = client.start_job("import time\ntime.sleep(1.0)\nmarker = 'set by the job'\nprint('job done')", name="slow")
    assert not job.done() and job.state == "running"
    after = stdout_of(run(client, "print(marker)"))  # queued behind the job on the session's worker
    assert after == "set by the job\n"
    assert job.wait(10) and job.state == "ok" and job.output() == "job done\n"


def test_every_output_is_kept_in_order_with_the_result(client):
    job = client.start_job(STEPS.format(n=50, pause=0) + "6 * 7")
    assert job.result(20) == "42"
    assert job.output() == "".join(f"step {i}\n" for i in range(50))
    assert job.tail(2) == "step 48\nstep 49"


def test_a_failing_job_raises_its_remote_error_from_result(client):
    job = client.start_job("def train():\n    raise ValueError('diverged')\ntrain()")
    with pytest.raises(RemoteError, match="ValueError: diverged") as err:
        job.result(10)
    assert "raise ValueError('diverged')" in plain("\n".join(err.value.traceback))
    assert job.state == "error"


def test_cancel_interrupts_the_job_and_keeps_the_session(client):
    run(client, "kept = 'namespace intact'")
    job = client.start_job(STEPS.format(n=1000, pause=0.05), name="long")
    assert wait_until(lambda: "step 2" in job.output(), 10)
    job.cancel()
    with pytest.raises(RemoteError, match="KeyboardInterrupt"):
        job.result(10)
    assert stdout_of(run(client, "print(kept)")) == "namespace intact\n"


def test_a_name_in_use_by_a_running_job_is_refused_by_the_client_and_the_server(client):
    first = client.start_job("import time\ntime.sleep(2)", name="train")
    with pytest.raises(ValueError, match="a job named 'train' is still running"):
        client.start_job("print(1)", name="train")
    # The server checks too (a second client of a named session knows nothing of this one's jobs):
    refused = client.request(Message(MessageType.EXECUTE, {"code": "print(1)", "job": "train"}))
    with pytest.raises(RemoteError, match="a job named 'train' is still running"):
        refused.wait(10)
    first.cancel()
    first.wait(10)


def test_the_server_lists_jobs_with_state_and_tail(client):
    done = client.start_job("print('first line')\nprint('last line')", name="quick")
    done.wait(10)
    running = client.start_job("import time\nprint('working', flush=True)\ntime.sleep(30)", name="busy")
    assert wait_until(lambda: "working" in running.output(), 10)
    listed = {j.name: j for j in client.jobs()}
    assert listed["quick"].state == "ok" and listed["quick"].tail() == "first line\nlast line"
    assert listed["busy"].state == "running" and listed["busy"].elapsed > 0
    running.cancel()
    assert running.wait(10)


def test_output_made_while_the_connection_is_lost_is_not_lost(tmp_path):
    """The server is paused (SIGSTOP) long enough for the client to declare it lost while the job's
    worker keeps printing; once it answers again the job fetches what it missed."""
    srv = start_server(tmp_path)
    client = srv.client(heartbeat_interval=0.2, heartbeat_timeout=1.0)
    try:
        job = client.start_job(STEPS.format(n=40, pause=0.1), name="through")
        assert wait_until(lambda: "step 3" in job.output(), 10)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: not client.connected, 10), "the client never noticed the pause"
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert job.wait(30), job
        assert job.state == "ok", job.error
        assert job.output() == "".join(f"step {i}\n" for i in range(40))
    finally:
        client.close()
        srv.stop()


# -- the magics ---------------------------------------------------------------------------------------
@pytest.fixture
def shell(server, capsys):
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "genie_jupyter")
    ip.run_line_magic("genie_init", f"127.0.0.1:{server.info.port} --token {server.info.token} --timeout 10")
    capsys.readouterr()
    yield ip
    genie_core.shutdown_sync()


def test_remote_bg_returns_a_job_in_underscore_and_genie_jobs_lists_it(shell, capsys):
    result = shell.run_cell("%%remote --bg --name train\nimport time\nprint('epoch 1', flush=True)\ntime.sleep(0.5)")
    assert result.success
    job = shell.user_ns["_"]
    assert job is result.result and job.name == "train"
    assert "started background job 'train'" in capsys.readouterr().out
    shell.run_cell("%%remote\nprint('queued')")
    captured = capsys.readouterr()
    assert "waits behind background job 'train'" in captured.err and "queued" in captured.out
    shell.run_line_magic("genie_jobs", "--text")
    table = capsys.readouterr().out
    assert "train" in table and "ok" in table and "epoch 1" in table
    assert shell.run_line_magic("genie_jobs", "train") is job


@pytest.mark.parametrize(
    ("cell", "error"),
    [
        ("%%remote --bg --pull x\nx = 1", "returns at once"),
        ("%%remote --name n\nx = 1", "add --bg"),
    ],
)
def test_remote_bg_options_that_cannot_work_are_one_clear_error(shell, cell, error):
    result = shell.run_cell(cell)
    assert isinstance(result.error_in_exec, UsageError) and error in str(result.error_in_exec)


def test_genie_jobs_names_the_jobs_when_asked_for_an_unknown_one(shell):
    shell.run_cell("%%remote --bg --name a\nprint(1)")
    with pytest.raises(UsageError, match=r"no job named 'b' in this session \(jobs: a\)"):
        shell.run_line_magic("genie_jobs", "b")


def test_many_short_jobs_back_to_back_each_end_in_order(client):
    """Many short jobs back to back: each ends, in order, none lost."""
    jobs = [client.start_job(f"print({i})") for i in range(20)]
    assert all(j.wait(20) for j in jobs)
    assert [j.output() for j in jobs] == [f"{i}\n" for i in range(20)]
    assert len({j.name for j in jobs}) == 20


# -- the handle's bookkeeping, with the server's answers given by the test -----------------------------
def _request(*replies: Message) -> Request:
    request = Request(Message(MessageType.EXECUTE, {"code": ""}), "test")
    for reply in replies:
        request.put(reply)
    return request


def test_outputs_lost_on_the_way_are_fetched_before_the_job_says_it_ended():
    """The reply says how many outputs there were; a job that holds fewer asks for the rest."""
    asked: list[dict[str, int]] = []

    def ask(since: dict[str, int]) -> list[dict]:
        asked.append(since)
        return [{"id": "j", "name": "j", "state": "ok", "messages": [[1, "stream", {"text": "b\n", "n": 1}]]}]

    request = _request(
        Message(MessageType.STREAM, {"text": "a\n", "n": 0}),
        Message(MessageType.STREAM, {"text": "c\n", "n": 2}),  # number 1 never arrived
        Message(MessageType.EXECUTE_REPLY, {"status": "ok", "outputs": 3}),
    )
    job = Job(ask, lambda rid: None, lambda: "", {"id": "j", "name": "j"}, request)
    assert job.wait(5) and job.state == "ok"
    assert asked == [{"j": 1}] and job.output() == "a\nb\nc\n"


def test_a_polled_job_asks_only_for_what_the_server_still_keeps_and_ends_when_its_session_does():
    asked: list[dict[str, int]] = []
    gone = {"why": ""}

    def ask(since: dict[str, int]) -> list[dict]:
        asked.append(dict(since))
        return [{"id": "j", "name": "j", "state": "running", "dropped": 3, "messages": []}]

    job = Job(ask, lambda rid: None, lambda: gone["why"], {"id": "j", "name": "j", "dropped": 3}, None)
    assert wait_until(lambda: len(asked) >= 2, 5)
    assert all(since == {"j": 3} for since in asked)  # outputs 0-2 were let go on the server
    gone["why"] = "the session ended"
    assert job.wait(5) and job.state == "unknown"
    with pytest.raises(ConnectionLost, match="the session ended"):
        job.result(1)


def test_the_server_keeps_a_bounded_output_per_job_and_a_bounded_number_of_ended_jobs(monkeypatch):
    from genie_core.server import jobs as server_jobs

    monkeypatch.setattr(server_jobs, "OUTPUT_BYTES", 2000)
    record = server_jobs.JobRecord("r", "big", "for i in range(100): print(i)")
    for i in range(100):
        record.add(Message(MessageType.STREAM, {"text": f"line {i}\n" + "x" * 40}, parent="r"))
    kept = [n for n, _, _ in record.messages]
    assert record.bytes <= 2000 and record.dropped == 100 - len(kept) > 0
    assert kept == list(range(record.dropped, 100))  # the newest are kept, numbered as they came
    assert [m[0] for m in record.to_dict(since=98)["messages"]] == [98, 99]

    table = server_jobs.Jobs()
    for i in range(server_jobs.ENDED_KEPT + 5):
        msg = Message(MessageType.EXECUTE, {"code": "pass", "job": f"j{i}"})
        assert table.start(msg) == ""
        table.finish(msg.id, {"status": "ok"})
    names = [j.name for j in table.by_id.values()]
    assert len(names) == server_jobs.ENDED_KEPT and names[-1] == f"j{server_jobs.ENDED_KEPT + 4}"
