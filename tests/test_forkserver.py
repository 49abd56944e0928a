"""The tests' fork server (tests/helpers/forkserver.py): what it reports of a forked process is that process's own."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers.forkserver import launch

LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def test_a_process_given_a_reused_pid_is_waited_for_itself_not_for_the_exit_of_the_pids_last_holder(tmp_path):
    """The kernel hands a freed pid to a new process (pid_max is 32,768 here; a suite forks tens of thousands). Here
    the next fork is made to take the pid of a forked process that has exited (ns_last_pid, as CRIU restores pids):
    the new process is running, and its wait answers when it ends, with its own exit code. Before, the earlier
    process's exit code answered at once: a test read plans.json before its plan worker wrote it (CI-like run,
    2026-12-06), and a trainer "finished" before its last step."""
    if not os.access(LAST_PID, os.W_OK):
        pytest.skip(f"{LAST_PID} is not writable here (root in its pid namespace): a pid cannot be reused on demand")
    gate, done = tmp_path / "gate", tmp_path / "done"
    (tmp_path / "ends.py").write_text("")
    os.mkfifo(gate)  # the second process runs until the test writes to it
    (tmp_path / "waits.py").write_text(
        "import sys\nfrom pathlib import Path\n"
        "Path(sys.argv[1]).read_text()\nPath(sys.argv[2]).write_text('done')\nsys.exit(3)\n"
    )
    earlier = launch(str(tmp_path / "ends.py"))
    assert earlier.wait(timeout=60) == 0
    for _ in range(50):  # another process may fork first and take the pid: then reuse this one's
        LAST_PID.write_text(str(earlier.pid - 1))
        process = launch(str(tmp_path / "waits.py"), str(gate), str(done))
        if process.pid == earlier.pid:
            break
        process.kill()
        process.wait(timeout=60)
        earlier = process
    else:
        pytest.fail("no fork took a freed pid in 50 tries")
    try:
        assert process.poll() is None  # running: the pid's earlier exit does not answer for it
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.2)
        opened = os.open(gate, os.O_RDWR | os.O_NONBLOCK)  # never blocks, whether or not the reader is there
        os.write(opened, b"go")
        os.close(opened)
        assert process.wait(timeout=120) == 3 and done.read_text() == "done"
    finally:
        process.kill()
