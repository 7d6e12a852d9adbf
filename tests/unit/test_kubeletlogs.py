"""The kubelet logs endpoint's pure parts: the URL as the apiserver sends it, --tail, which file answers."""

from __future__ import annotations

from pathlib import Path

import pytest
from tpujob_devcluster import kubeletlogs
from tpujob_devcluster.kubeletlogs import BadRequest, LogRequest, log_file, parse_request, tail


def test_the_apiserver_s_url_parses_into_the_request():
    url = "/containerLogs/ml/llama-a0-slice-0-0-x/trainer?follow=true&tailLines=10&limitBytes=500&previous=false"
    assert parse_request(url) == LogRequest("ml", "llama-a0-slice-0-0-x", "trainer", True, False, 10, 500)
    assert parse_request("/containerLogs/ml/p/c") == LogRequest("ml", "p", "c")
    assert parse_request("/exec/ml/p/c") is None
    with pytest.raises(BadRequest, match="tailLines"):
        parse_request("/containerLogs/ml/p/c?tailLines=-1")


def test_tail_counts_lines_as_kubectl_does():
    data = b"a\nb\nc\n"
    assert tail(data, None) == data and tail(data, 0) == b""
    assert tail(data, 2) == b"b\nc\n" and tail(data, 5) == data
    assert tail(b"a\nb\nunfinished", 1) == b"unfinished"  # a line still being written counts


def test_the_file_that_answers_is_the_container_s_or_its_previous_one(tmp_path: Path):
    pod = tmp_path / "ml" / "p"
    with pytest.raises(FileNotFoundError, match='pod "p" in namespace "ml" not found'):
        log_file(tmp_path, LogRequest("ml", "p", "trainer"))
    pod.mkdir(parents=True)
    (pod / kubeletlogs.CONTAINER_FILE).write_text("trainer")
    assert log_file(tmp_path, LogRequest("ml", "p", "trainer")) == pod / kubeletlogs.LOG_FILE
    with pytest.raises(BadRequest, match='container "other" in pod "p" is not valid'):
        log_file(tmp_path, LogRequest("ml", "p", "other"))
    with pytest.raises(BadRequest, match="previous terminated container"):
        log_file(tmp_path, LogRequest("ml", "p", "trainer", previous=True))
    (pod / kubeletlogs.PREVIOUS_LOG_FILE).write_text("before\n")
    assert log_file(tmp_path, LogRequest("ml", "p", "trainer", previous=True)) == pod / kubeletlogs.PREVIOUS_LOG_FILE
