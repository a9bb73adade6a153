"""The OpenAPI document of the management API: it matches the routes, and fuzzing it finds no 5xx."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import hypothesis
import pydantic
import pytest
import schemathesis
from aiohttp import web
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from proxy.app import build_app
from proxy.management.memories import OPENAPI_PATH
from proxy.management.shared import MAX_TEXT_CHARS, NOT_WHITESPACE, Text
from tests.support.live_app import admin_settings, live_app

DOCUMENT = json.loads(OPENAPI_PATH.read_text())
METHODS = {"get", "post", "put", "patch", "delete"}


def app_operations(app: web.Application) -> set[tuple[str, str]]:
    """(method, path template) of every /v1/memory route in the app."""
    found = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if path.startswith("/v1/memory") and route.method != "HEAD":
            found.add((route.method.lower(), path))
    return found


def document_operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    """(method, path template) of every operation in the document."""
    return {(method, path) for path, item in document["paths"].items() for method in item if method in METHODS}


def test_every_route_is_documented_and_every_documented_route_exists() -> None:
    """An API client generated from the document can reach every route, and nothing in it is a dead end."""
    assert app_operations(build_app(admin_settings())) == document_operations(DOCUMENT)


def test_document_is_openapi_31_with_bearer_security_everywhere() -> None:
    """The document declares OpenAPI 3.1 and the admin bearer key for every operation."""
    assert DOCUMENT["openapi"].startswith("3.1")
    assert DOCUMENT["security"] == [{"adminKey": []}]
    assert DOCUMENT["components"]["securitySchemes"]["adminKey"]["scheme"] == "bearer"
    for path, item in DOCUMENT["paths"].items():
        for method in METHODS & item.keys():
            assert "security" not in item[method], f"{method} {path} overrides security"
            assert "401" in item[method]["responses"], f"{method} {path} does not document 401"


def test_path_parameters_are_declared() -> None:
    """Every {placeholder} in a path has a parameter definition (clients can fill the URL)."""
    components = DOCUMENT["components"]["parameters"]
    for path, item in DOCUMENT["paths"].items():
        declared = {components[p["$ref"].rsplit("/", 1)[1]]["name"] for p in item.get("parameters", [])}
        assert set(re.findall(r"{(\w+)}", path)) <= declared, path


def _text_schemas(node: Any) -> Iterator[dict[str, Any]]:
    """Every string schema in the document whose maxLength is the management API's text limit."""
    if isinstance(node, dict):
        if node.get("type") == "string" and node.get("maxLength") == MAX_TEXT_CHARS:
            yield node
        for value in node.values():
            yield from _text_schemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from _text_schemas(value)


def test_text_fields_refuse_exactly_what_the_document_calls_blank() -> None:
    """A text the document's pattern calls whitespace only (ECMA-262 semantics: U+0085 and U+FEFF among them) is
    refused by the server, and one it accepts is accepted (a fuzzer found "\\x85" refused as schema-valid)."""
    schemas = list(_text_schemas(DOCUMENT))
    assert len(schemas) == 4
    assert {schema["pattern"] for schema in schemas} == {NOT_WHITESPACE}
    text = pydantic.TypeAdapter(Text)
    for value in ["a", " a ", "\x1c", "x\x85", "\x85", "\ufeff", " \ufeff\u3000 ", "\u2028", " ", ""]:
        valid_in_document = re.search(NOT_WHITESPACE, value) is not None
        try:
            text.validate_python(value)
            accepted = True
        except pydantic.ValidationError:
            accepted = False
        assert accepted == valid_in_document, repr(value)


# --- fuzzing ------------------------------------------------------------------------------------------

KEY = "schema-fuzz-key"
SCHEMA = schemathesis.openapi.from_path(OPENAPI_PATH)


@pytest.fixture(scope="module")
def live_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real app with memory on, served in a thread; the memory LLM points at a closed local port."""
    settings = admin_settings(
        admin={"api_key": KEY},
        upstream={"base_url": "http://127.0.0.1:9/v1"},
        storage={"path": str(tmp_path_factory.mktemp("fuzz"))},
    )
    with live_app(settings) as url:
        yield url


def excused_checks(case: schemathesis.Case) -> list[Any]:
    """Checks this case may fail for reasons the document cannot express (see each reason)."""
    excused: list[Any] = []
    # A cursor is opaque: any string fits the schema, but only a next_cursor the server gave out is accepted
    # (a 400 names the cursor otherwise).
    if case.query and "cursor" in case.query:
        excused.append(positive_data_acceptance)
    # A query parameter whose value is None or an empty list is left out of the URL by the HTTP client, so an
    # "extra parameter" case such as {"limit": 3, "": []} reaches the server as a valid request.
    if case.query and any(value is None or value == [] for value in case.query.values()):
        excused.append(negative_data_rejection)
    return excused


@SCHEMA.parametrize()
@hypothesis.settings(
    max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(hypothesis.HealthCheck)
)
def test_fuzzed_requests_get_no_server_error(case: schemathesis.Case, live_url: str) -> None:
    """Requests generated from the document (valid and invalid) never get a 5xx and match the document."""
    case.call_and_validate(
        base_url=live_url, headers={"Authorization": f"Bearer {KEY}"}, excluded_checks=excused_checks(case)
    )
