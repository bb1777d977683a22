"""Whether this process is a fork of one that had a session (a DataLoader worker, multiprocessing's
"fork"): its sockets are the parent's, their I/O threads did not come with it; using them would
hang, or mix its messages into the parent's session. connection.py sets it after a fork."""

from __future__ import annotations

from_a_session = False


def refuse_in_a_forked_child() -> None:
    """As CUDA refuses to be initialized again in a forked subprocess."""
    if from_a_session:
        raise RuntimeError(
            "Cannot use remote_accelerator tensors in a forked subprocess: the session is its parent's. Make them in "
            "the parent process, or use the 'spawn' start method (DataLoader(multiprocessing_context='spawn'))"
        )
