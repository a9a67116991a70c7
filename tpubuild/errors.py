"""User-facing errors: one exception type that carries where the problem is."""

from __future__ import annotations


class TpuBuildError(Exception):
    """A problem with the user's input, reported without a traceback.

    Every field is optional; the message names whichever of file, model, stage
    and op location are known, then the problem, then what the user can do.
    """

    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        model: str | None = None,
        stage: str | None = None,
        loc: str | None = None,
        hint: str | None = None,
    ):
        super().__init__(problem)
        self.problem = problem
        self.file = file
        self.model = model
        self.stage = stage
        self.loc = loc
        self.hint = hint

    def with_context(self, **ctx: str | None) -> TpuBuildError:
        """Fill in context fields that are still unknown (outer layers know more)."""
        for key, value in ctx.items():
            if value is not None and getattr(self, key) is None:
                setattr(self, key, value)
        return self

    def __str__(self) -> str:
        where = []
        if self.model:
            where.append(f"model {self.model}")
        if self.stage:
            where.append(f"stage {self.stage}")
        if self.file:
            where.append(str(self.file))
        if self.loc:
            where.append(f"op {self.loc!r}")
        text = (", ".join(where) + ": " if where else "") + self.problem
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


def read_user_text(path, what: str = "file", hint: str | None = None) -> str:
    """The text of a file the user named; missing or unreadable, a TpuBuildError naming it (and `hint`)."""
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TpuBuildError(f"{what} not found", file=str(path), hint=hint) from None
    except (OSError, UnicodeDecodeError) as err:
        raise TpuBuildError(f"cannot read the {what} ({err})", file=str(path)) from None
