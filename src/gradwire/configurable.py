"""Options held as attributes, with a config dict that round-trips (numcodecs' convention).

Shared by codecs and sparsifiers: subclasses take keyword-only options in ``__init__`` and keep
each under the attribute of the same name.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar


class Configurable:
    """Options as attributes, ``get_config()`` and equality, for codecs and sparsifiers.

    Subclasses take their options as keyword-only arguments of ``__init__`` and keep each under
    the attribute of the same name; equality, hashing and ``repr`` then follow from
    :meth:`get_config`, so two objects with the same options are interchangeable.
    """

    #: Registry name, e.g. ``"rice"`` or ``"topk"``.
    name: ClassVar[str]

    @classmethod
    def parameter_names(cls) -> tuple[str, ...]:
        """The keyword-only options ``__init__`` accepts."""
        signature = inspect.signature(cls.__init__)
        return tuple(
            name
            for name, parameter in signature.parameters.items()
            if name != "self" and parameter.kind is inspect.Parameter.KEYWORD_ONLY
        )

    def get_config(self) -> dict[str, Any]:
        """``{"id": name, **options}``: plain Python values, JSON-serializable."""
        config: dict[str, Any] = {"id": self.name}
        for parameter in self.parameter_names():
            config[parameter] = getattr(self, parameter)
        return config

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(tuple(sorted((key, repr(value)) for key, value in self.get_config().items())))

    def __repr__(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in self.get_config().items() if key != "id")
        return f"{type(self).__name__}({options})"


def instantiate(kind: str, registry: dict[str, type], name: Any, params: dict[str, Any]) -> Any:
    """``registry[name](**params)``, refusing unknown names and options by name.

    Args:
        kind: what is being built, for messages (``"index_codec"``, ``"sparsifier"``).
        registry: the registered classes by name.
        name: the name asked for.
        params: keyword options for the class.

    Returns:
        The instance.

    Raises:
        ValueError: ``name`` is not registered, or the class takes no option of some name;
            the message names ``kind`` and what is allowed. The class's own ``ValueError`` on a
            bad value passes through.
    """
    from .errors import check_choice

    check_choice(kind, name, sorted(registry))
    cls = registry[name]
    allowed = cls.parameter_names()
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"{kind} {name!r} has no option {', '.join(unknown)}; "
                         f"allowed: {', '.join(allowed) or '(none)'}")
    return cls(**params)
