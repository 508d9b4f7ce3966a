"""The REST contract (docs/api.md): the document the gateway serves is valid OpenAPI 3.1, the
one in the docs, and what the live gateway answers, checked by schemathesis on every route."""

from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from openapi_spec_validator import validate
from schemathesis.specs.openapi.checks import positive_data_acceptance

from cosyvoice import openapi

from ..helpers import ROOT

pytestmark = pytest.mark.system


def test_the_served_document_is_valid_openapi_and_the_one_in_the_docs(service):
    served = requests.get(service.url + "/openapi.json", timeout=10).json()
    validate(served)
    assert served["openapi"].startswith("3.1")
    assert served == json.loads((ROOT / "docs" / "openapi.json").read_text())
    assert served == openapi.document()  # (the service runs the default settings)
    assert (ROOT / "docs" / "api.md").read_text() == openapi.markdown(openapi.document())
    # every REST route of the app is in it, and nothing else
    routes = {path for path in served["paths"]}
    assert {"/v1/audio/transcriptions", "/v1/listen", "/v1/models", "/healthz"} <= routes


@pytest.fixture
def live_schema(service):
    # valid requests, and requests that break the schema (which must be refused with a
    # 4xx, never a 500), the same examples in every run
    config = schemathesis.Config()
    config.projects.default.generation.update(
        modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
        deterministic=True)
    return schemathesis.openapi.from_url(service.url + "/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("live_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_route_answers_as_its_contract_says(case):
    # No 500, a documented status, content type, headers and body for each answer, 405
    # with Allow for an undeclared method. Left out: that every schema-valid request is
    # accepted. Random bytes are a schema-valid recording that holds no audio (400), and
    # some rules span fields, which OpenAPI cannot say of query parameters (Deepgram's
    # sample_rate is required with a raw encoding).
    case.call_and_validate(timeout=60, excluded_checks=[positive_data_acceptance])
