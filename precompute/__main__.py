from vt.precompute.cli import app

app()
