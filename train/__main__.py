from vt.train.cli import app

app()
