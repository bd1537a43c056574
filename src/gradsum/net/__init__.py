"""Thin I/O shells over ``gradsum.dataplane``: UDP daemons, the worker client, loss injection."""
