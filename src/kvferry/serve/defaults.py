"""Defaults the argument parser (``serve/cli.py``) and the app
(``serve/app.py``) share: here, so that the app never imports the argparse
module (which imports the server, which imports the app)."""

DEFAULT_MAX_REQUEST_BODY_BYTES = 2 * 2**20
