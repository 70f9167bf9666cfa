import sys

from host.process import configure_process

configure_process()  # before host.cli, and so before anything can import grpc

from host.cli import main  # noqa: E402

sys.exit(main())
