"""Each dialect is named once (:data:`edge_sdk.server.dialects.SERVED_DIALECTS`): the app serves every route of
every dialect listed, and ``coveil edge serve --help`` names each POST route."""

from __future__ import annotations

import argparse

from edge_sdk.server.cli import add_serve_parser
from edge_sdk.server.dialects import SERVED_DIALECTS
from tests.support.fake_endpoint import fake_endpoint


def routes(router: object) -> set[tuple[str, str]]:
    return {(method, route.path) for route in router.routes for method in getattr(route, "methods", ())}


def test_the_app_serves_every_route_of_every_dialect_listed() -> None:
    app, _ = fake_endpoint()
    listed = set().union(*(routes(dialect.load()) for dialect in SERVED_DIALECTS))
    assert ("POST", "/v1/messages") in listed and ("POST", "/api/chat") in listed  # the four dialects, by one each
    served = {(method.upper(), path) for path, operations in app.openapi()["paths"].items() for method in operations}
    assert {(method, path) for method, path in listed if method == "POST"} <= served


def test_the_help_names_every_post_route() -> None:
    commands = argparse.ArgumentParser().add_subparsers()
    text = " ".join(add_serve_parser(commands).format_help().split())
    posts = sorted(path for dialect in SERVED_DIALECTS for method, path in routes(dialect.load()) if method == "POST")
    assert len(posts) == 9
    assert [path for path in posts if path not in text] == []
