"""Reject query parameters a route does not declare (a typo must not silently widen a query),
and scalar parameters given more than once (which value would win is a guess)."""

from __future__ import annotations

import types
import typing

from fastapi import Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute


def _query_names(dependant: Dependant) -> frozenset[str]:
    """Every query parameter of a route and its dependencies (a few list walks: cheap)."""
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return frozenset(names)


SEQUENCES = (list, tuple, set, frozenset)


def _is_sequence(annotation: object) -> bool:
    """``list[str]``, ``list[str] | None``, ``Annotated[list[str], ...]``: repeatable in a query."""
    origin = typing.get_origin(annotation)
    if origin in SEQUENCES:
        return True
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return any(_is_sequence(arg) for arg in typing.get_args(annotation))
    return False


def _scalar_names(dependant: Dependant) -> frozenset[str]:
    names = {p.alias for p in dependant.query_params if not _is_sequence(p.field_info.annotation)}
    for sub in dependant.dependencies:
        names |= _scalar_names(sub)
    return frozenset(names)


def reject_unknown_query(request: Request) -> None:
    """A 422 naming every unknown query parameter and every scalar one given twice."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute) or not route.include_in_schema:
        return  # the web console's pages read and check their own parameters
    given = request.query_params
    unknown = sorted(set(given) - _query_names(route.dependant))
    repeated = sorted(
        name for name in _scalar_names(route.dependant) if len(given.getlist(name)) > 1
    )
    errors = [
        {
            "type": "extra_forbidden",
            "loc": ("query", name),
            "msg": "unknown query parameter",
            "input": None,
        }
        for name in unknown
    ] + [
        {
            "type": "too_long",
            "loc": ("query", name),
            "msg": "query parameter given more than once; give it once",
            "input": None,
        }
        for name in repeated
    ]
    if errors:
        raise RequestValidationError(errors)
