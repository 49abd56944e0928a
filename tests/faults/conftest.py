"""Fixtures for fault tests: a moto S3 server behind a gate that can fail like a real store, or restart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers.s3_gate import Gate, RecordedMoto


@pytest.fixture
def gated_s3(tmp_path, monkeypatch):
    """A fresh bucket on a journaling moto server reached through a Gate; the AWS environment points at the gate.

    Yields SimpleNamespace(uri="s3://<bucket>", gate=Gate, moto=RecordedMoto, bucket=name).
    """
    import boto3

    moto = RecordedMoto(tmp_path / "moto-journal.jsonl")
    gate = Gate(moto.port)
    for key, value in {
        "AWS_ENDPOINT_URL": gate.url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    bucket = "vt-faults"
    boto3.client("s3", endpoint_url=gate.url).create_bucket(Bucket=bucket)
    try:
        yield SimpleNamespace(uri=f"s3://{bucket}", gate=gate, moto=moto, bucket=bucket)
    finally:
        gate.close()
        moto.stop()
