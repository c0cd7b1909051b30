"""The Training tab behind a proxy that serves Airflow under a subpath, in Chromium.

``airflow standalone`` with ``[api] base_url = http://localhost:<port>/airflow/``, and in front of it a
reverse proxy (this module's, on its own port) that forwards only ``/airflow/...`` and answers 404 to
anything else, as a proxy that hosts other applications beside Airflow does. A one-task DAG trains
a tiny group; Chromium logs in through the proxy, opens the task instance's Training tab and must
see the group (its state, its ranks) in the tab's frame. Before the fix the tab's link was absolute
(``/torchrun/view/...``): the frame asked the proxy for a path outside ``/airflow/`` and got 404.
About a minute on two cores.
"""

from __future__ import annotations

import http.client
import os
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import quote, urlsplit

import pytest

from tests.conftest import TINY_DDP
from tests.pipeline_ui.test_pipeline_ui import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _missing_browser, _not_blank
from tests.standalone import Standalone, start_standalone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DAG_ID = "subpath_training"
PREFIX = "/airflow"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class PrefixProxy:
    """Forwards ``PREFIX/...`` to ``upstream`` (same path), 404 for everything else; records what it refused."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.refused: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                if not (self.path == PREFIX or self.path.startswith(PREFIX + "/")):
                    proxy.refused.append(self.path)
                    body = b"not behind this proxy's /airflow/"
                    self.send_response(404)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                conn.request(self.command, self.path, body=data, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
                self.send_response(resp.status)
                for key, value in resp.getheaders():
                    if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)
                conn.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> PrefixProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def behind_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Standalone, PrefixProxy]]:
    root = tmp_path_factory.mktemp("subpath")
    dags = root / "dags"
    dags.mkdir()
    script = root / "tiny_ddp.py"
    script.write_text(TINY_DDP)
    (dags / f"{DAG_ID}.py").write_text(
        textwrap.dedent(
            f"""
            import pendulum
            from airflow.sdk import DAG
            from airflow_torchrun import DistributedTrainingOperator

            with DAG({DAG_ID!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
                DistributedTrainingOperator(
                    task_id="train", script={str(script)!r}, num_nodes=2, nproc_per_node=1, track=False,
                    env={{"STEPS": "6"}},
                )
            """
        )
    )
    extra = {"AIRFLOW__CORE__DEFAULT_TASK_RETRIES": "1", "AIRFLOW__CORE__DEFAULT_TASK_RETRY_DELAY": "0"}
    with (
        start_standalone(root, dags, DAG_ID, "train", extra_env=extra, base_path=PREFIX) as server,
        PrefixProxy(server.base_url) as proxy,
    ):
        yield server, proxy


def test_the_training_tab_works_under_a_subpath_behind_a_proxy(behind_proxy: tuple[Standalone, PrefixProxy]) -> None:
    missing = _missing_browser()
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI must run the UI test: {missing}")
    if missing:
        pytest.skip(missing)
    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # a loaded machine renders the frame slower than the default 5 s
    server, proxy = behind_proxy
    server.unpause()
    run_id = server.trigger({})
    assert server.wait_run_state(run_id, {"success", "failed"}) == "success"
    public = proxy.url + PREFIX
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "training-under-subpath.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.set_default_timeout(60_000)
            view = f"/dags/{DAG_ID}/runs/{quote(run_id, safe='')}/tasks/train/plugin/torchrun-training"
            page.goto(public + view)
            page.get_by_label("Username").fill(server.username)
            page.get_by_label("Password").fill(server.password)
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url(f"**{view}")
            frame_element = page.locator("iframe")
            expect(frame_element).to_have_count(1)
            frame = page.frame_locator("iframe")
            expect(frame.locator("#group-state")).to_have_text("succeeded")
            expect(frame.locator("#ranks tr[data-rank]")).to_have_count(2)
            src = page.frame_locator("iframe").locator(":root").evaluate("() => location.pathname")
            assert str(src).startswith(f"{PREFIX}/torchrun/view/{DAG_ID}/"), src
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    _not_blank(shot)
    assert not [p for p in proxy.refused if "torchrun" in p], f"asked outside {PREFIX}/: {proxy.refused}"
