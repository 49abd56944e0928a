"""What the tests share beside their fixtures: importable helpers (`from helpers.polling import wait_for`) and the
worker scripts that tests start by path as processes of their own (`HELPERS / "view_worker.py"`).

tests/ is on sys.path (pytest puts the folder of tests/conftest.py there); a worker script started by path finds
the package the same way (tests/helpers/gpu_trace_worker.py puts tests/ there itself), and the workers that run
under tests/helpers/forkserver.py import nothing from tests/.
"""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent  # the worker scripts' folder
