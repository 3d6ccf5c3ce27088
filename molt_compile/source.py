"""Where every value of a resolved recipe came from: a file position, `--set`, or the schema default."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pos:
    """A value's origin. `file`/`line`/`col` (1-based) when written in a YAML file; `layer` says how it got there."""

    file: str | None
    line: int | None
    col: int | None
    layer: str = "file"
    """`file` (written in the recipe or a base it extends), `--set`, or `default`."""


@dataclass
class SourceMap:
    """Dotted recipe path (`actor.mesh.ep`, list items as `rollout.clip.0`) -> where its value was set.

    Paths use the YAML key names (`train.async.queue_size`), not Python attribute names.
    """

    positions: dict[str, Pos] = field(default_factory=dict)
    root_file: str | None = None
    job_root: str | None = None
    """Absolute project root of the root recipe (`load.find_project`): every relative path in the plan is relative
    to it, and the job runs there. None: the recipe is in no project, and the plan's paths are absolute."""
    lines: dict[str, list[str]] = field(default_factory=dict)
    """File name -> its source lines, for rendering carets."""

    def pos(self, path: str) -> Pos:
        """The position of `path`, or of its nearest written ancestor, or a `default` marker."""
        probe = path
        while probe:
            if probe in self.positions:
                found = self.positions[probe]
                return found if probe == path else Pos(found.file, found.line, found.col, "default")
            probe = probe.rpartition(".")[0]
        return Pos(self.root_file, None, None, "default")

    def is_set(self, path: str) -> bool:
        """True when the user wrote this key (in a file or with --set), False when it is a default."""
        return path in self.positions
