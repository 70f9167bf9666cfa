import sys

from host.process import configure_process, pause_collector

configure_process()  # before host.cli, and so before anything can import grpc
pause_collector()  # until start-up is over (host/process.py)

from host.cli import main  # noqa: E402

sys.exit(main())
