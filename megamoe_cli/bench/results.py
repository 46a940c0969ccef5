"""The result schema (the one owner of column names) and the results store.

One row per (run, point).  Columns whose meaning is not in their name:

- ``num_tokens``: tokens per rank; when ranks differ it is the largest, with
  ``num_tokens_min`` / ``num_tokens_max`` giving the spread.
- ``config``: JSON of what the backend reports it used; ``block_m`` from it.
- ``time_us_*``: median / min / max over the timed samples of the slowest rank
  (the rank with the largest median, ``slowest_rank``): the layer's time.
- ``calls_per_sample``: calls back to back in each timed sample (one barrier
  before the sample); ``time_us_*`` are per call (the sample / this).  1 is one
  call right after a barrier; rows written before the column existed read as 1.
- ``inputs_copy_timed``: copying the inputs into the backend's communication
  buffers is inside the timed region.
- ``tflops``, ``hbm_gbps``, ``nvlink_gbps``: per GPU, from the modelled work
  and bytes (``bench.metrics``) over the layer time.
- ``floor_us``: roofline floor of the layer on this GPU (``floor_bound``: the
  term that sets it); ``floor_fraction = floor_us / time_us_median``, 1.0 is
  the roofline.  Empty on CPU.
- ``rel_err_layer``: ``||y - y_ref|| / ||y_ref||`` of the whole layer against the
  distributed reference, every rank's rows pooled (``reference.layer.pooled_relative_error``):
  what the GPU tests and ``megamoe tune`` judge; empty when the point ran without
  ``check``, and in rows written before the column existed.
- ``rel_err``: the same ratio on the worst rank alone.  A rank holding a token or two
  scatters far more than the layer by rounding alone (see ``reference``).
- ``run_id``: one ``megamoe bench`` invocation; rows of one run compare
  directly (``speedup_vs_baseline`` against the fastest baseline, named in ``baseline``, in the
  summary view: ``bench.compare.summary``).

Files are chosen by extension: ``.csv`` (default), ``.jsonl`` or ``.parquet``
(needs pyarrow).  Appending never rewrites rows that
are already there in place: CSV and JSON Lines are appended to (one write per
batch, flushed and fsync'd); Parquet, which cannot be appended to, is rewritten
to a temporary file that atomically replaces the old one.

Reading refuses what is not a whole results file, with one ``MegaMoEError`` that
names the file, the line where there is one, and what to do: a file that is not
one (not UTF-8, no ``status``/``backend`` columns, another program's JSON Lines),
and a damaged row (bytes that are not text, a row whose field count differs from
the header's, a JSON line cut short).  ``check_output_path`` applies the same
reading to an existing ``--out``, and asks the filesystem whether it may write
there, before a run starts.

Imports: ``envinfo`` (the environment columns).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import numbers
import os
import stat
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from ..files import atomic_write, check_writable
from ..errors import MegaMoEError
from .envinfo import ENV_COLUMNS, utc_now

SHAPE_COLUMNS = ("hidden", "intermediate", "num_experts", "num_topk")

# Order is the column order of every results file.
COLUMNS = (
    "run_id",
    "date",
    "sweep",
    "preset",
    *SHAPE_COLUMNS,
    "weights",
    "activation_clamp",
    "num_tokens",
    "num_tokens_min",
    "num_tokens_max",
    "num_max_tokens_per_rank",
    "world_size",
    "backend",
    "config",
    "block_m",
    "routing",
    "seed",
    "warmup",
    "iters",
    "calls_per_sample",
    "flush_l2",
    "inputs_copy_timed",
    "device",
    "status",
    "error",
    "time_us_median",
    "time_us_min",
    "time_us_max",
    "slowest_rank",
    "num_pairs",
    "recv_pairs_max",
    "tflops",
    "hbm_gbps",
    "nvlink_gbps",
    "floor_us",
    "floor_fraction",
    "floor_bound",
    "rel_err",
    "rel_err_layer",
    *ENV_COLUMNS,
)

STATUS_OK = "ok"
STATUS_FAILED = "failed"

FLOAT_COLUMNS = (
    "time_us_median",
    "time_us_min",
    "time_us_max",
    "tflops",
    "hbm_gbps",
    "nvlink_gbps",
    "floor_us",
    "floor_fraction",
    "rel_err",
    "rel_err_layer",
    "activation_clamp",
)
INT_COLUMNS = (
    *SHAPE_COLUMNS,
    "num_tokens",
    "num_tokens_min",
    "num_tokens_max",
    "num_max_tokens_per_rank",
    "world_size",
    "block_m",
    "seed",
    "warmup",
    "iters",
    "calls_per_sample",
    "slowest_rank",
    "num_pairs",
    "recv_pairs_max",
    "gpu_count",
)
BOOL_COLUMNS = ("flush_l2", "inputs_copy_timed", "git_dirty")
# Columns that identify "the same problem" when comparing backends of one run.
PROBLEM_COLUMNS = (
    "run_id",
    *SHAPE_COLUMNS,
    "weights",
    "activation_clamp",
    "num_tokens",
    "num_tokens_min",
    "num_tokens_max",
    "world_size",
    "routing",
    "seed",
)

# Columns added after results files were written, with the value every older row was measured with;
# reading fills it into rows that lack one.
ADDED_COLUMNS = {"calls_per_sample": 1, "weights": "fp8", "activation_clamp": 0.0}

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".parquet": "parquet"}

Row = Dict[str, Any]


def make_row(
    point: Any,
    *,
    run_id: str,
    world_size: int,
    device: str,
    env: Dict[str, Any],
    status: str,
    error: str = "",
    timing: Optional[Dict[str, Any]] = None,
    metrics: Optional[Dict[str, Any]] = None,
    rel_err: Optional[float] = None,
    rel_err_layer: Optional[float] = None,
    config: Optional[Dict[str, Any]] = None,
    inputs_copy_timed: Optional[bool] = None,
) -> Row:
    """One result row for ``point`` (a ``sweep.Point``); absent measurements are NaN."""
    tokens = [point.tokens_for_rank(r, world_size) for r in range(world_size)]
    used = dict(point.config if config is None else config)
    nan = float("nan")
    row: Row = {
        "run_id": run_id,
        "date": utc_now(),
        "sweep": point.sweep,
        "preset": point.preset or "",
        "hidden": point.hidden,
        "intermediate": point.intermediate,
        "num_experts": point.num_experts,
        "num_topk": point.num_topk,
        "weights": point.weights,
        "activation_clamp": point.activation_clamp,
        "num_tokens": max(tokens),
        "num_tokens_min": min(tokens),
        "num_tokens_max": max(tokens),
        "num_max_tokens_per_rank": point.num_max_tokens_per_rank,
        "world_size": world_size,
        "backend": point.backend,
        "config": json.dumps(used, sort_keys=True),
        "block_m": used.get("block_m", point.block_m),
        "routing": point.routing,
        "seed": point.seed,
        "warmup": point.warmup,
        "iters": point.iters,
        "calls_per_sample": point.calls_per_sample,
        "flush_l2": point.flush_l2,
        "inputs_copy_timed": inputs_copy_timed,
        "device": device,
        "status": status,
        "error": error,
        "time_us_median": nan,
        "time_us_min": nan,
        "time_us_max": nan,
        "slowest_rank": None,
        "num_pairs": None,
        "recv_pairs_max": None,
        "tflops": nan,
        "hbm_gbps": nan,
        "nvlink_gbps": nan,
        "floor_us": nan,
        "floor_fraction": nan,
        "floor_bound": "",
        "rel_err": nan if rel_err is None else rel_err,
        "rel_err_layer": nan if rel_err_layer is None else rel_err_layer,
    }
    for source in (timing or {}, metrics or {}):
        for key, value in source.items():
            if key not in row:
                raise MegaMoEError(f"result column {key!r} is not in the schema (results.COLUMNS)")
            row[key] = value
    for key in ENV_COLUMNS:
        row[key] = env.get(key)
    return {key: row[key] for key in COLUMNS}


def file_format(path: Union[str, Path]) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise MegaMoEError(
            f"{path}: unknown results format {suffix or '(no extension)'!r}; "
            f"expected one of {', '.join(FORMATS)}"
        )
    if FORMATS[suffix] == "parquet" and importlib.util.find_spec("pyarrow") is None:
        raise MegaMoEError(
            f"{path}: writing Parquet needs pyarrow (pip install pyarrow); use .csv or .jsonl instead"
        )
    return FORMATS[suffix]


def check_output_path(path: Union[str, Path]) -> List[str]:
    """Fail before a run starts if its results could not be written: an unknown format, a
    folder, a FIFO or device, a path that cannot be written, or an existing file that is not a
    results file.  Returns the warning line of an existing file's damaged rows (the run appends
    after them; readers skip them), if any."""
    path = Path(path)
    fmt = file_format(path)
    _check_regular(path, f"{fmt} results file")
    check_writable(path, f"{fmt} results file", replaced=fmt == "parquet")
    if path.exists() and path.stat().st_size:
        damage = Damage(path)
        _typed(_load(path, foreign_hint="; choose another output file", damage=damage), damage)
        warning = damage.warning()
        return [warning] if warning else []
    return []


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def row_to_json(row: Row) -> str:
    """JSON text of a row; NaN becomes null so the line stays valid JSON."""
    return json.dumps({k: _clean(v) for k, v in row.items()}, sort_keys=False)


def check_row(row: Row, path: Union[str, Path] = "results") -> None:
    """Refuse a row a reader could not read back as it was meant (a count no 64-bit integer
    holds, a time that is not a number, no status or backend): it is not written, so it cannot
    spoil the file for every later reader."""
    def refuse(column: str, why: str) -> MegaMoEError:
        return MegaMoEError(f"{path}: row not written: column {column} {why}, got {_short(row.get(column))!r}")

    for column in IDENTITY_COLUMNS:
        if not isinstance(row.get(column), str) or not row.get(column):
            raise refuse(column, "must be a non-empty string")
    for column in INT_COLUMNS:
        value = row.get(column)
        if not _missing(value) and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                    or not -INT64_MAX - 1 <= int(value) <= INT64_MAX):
            raise refuse(column, "must be an integer that 64 bits hold")
    for column in FLOAT_COLUMNS:
        value = row.get(column)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise refuse(column, "must be a number")


def row_as_object(row: Row) -> Dict[str, Any]:
    """A row for ``--json``: NaN as null and ``config`` (JSON text in files) as the object it holds."""
    out = {k: _clean(v) for k, v in row.items()}
    config = out.get("config")
    if isinstance(config, str):
        try:
            out["config"] = json.loads(config)
        except ValueError:
            pass
    return out


def _csv_cell(value: Any) -> str:
    value = _clean(value)
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


# What makes a file a results file: every row of every version of the schema has these.
IDENTITY_COLUMNS = ("status", "backend")
# Lines of a damaged file named in its one warning line; the count says how many there were.
_LINES_NAMED = 5
INT64_MAX = 2 ** 63 - 1


class Damage:
    """What a reader skipped or could not read in one file, said in one warning line."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: List[tuple] = []  # (line, why) of each row skipped
        self.cells: Dict[str, List[tuple]] = {}  # column -> (line, text) of each cell read as missing

    def row(self, line: int, why: str) -> None:
        self.rows.append((line, why))

    def cell(self, column: str, line: Optional[int], text: Any) -> None:
        self.cells.setdefault(column, []).append((line, text))

    def warning(self) -> Optional[str]:
        parts = []
        if self.rows:
            named = "; ".join(f"line {line}: {why}" for line, why in self.rows[:_LINES_NAMED])
            more = f"; and {len(self.rows) - _LINES_NAMED} more" if len(self.rows) > _LINES_NAMED else ""
            parts.append(f"{len(self.rows)} damaged row(s) skipped ({named}{more})")
        for column, found in self.cells.items():
            line, text = found[0]
            where = f"line {line}: " if line else ""
            parts.append(f"{len(found)} value(s) of column {column} read as missing ({where}{_short(text)!r}"
                         f"{', ...' if len(found) > 1 else ''})")
        return f"{self.path}: " + "; ".join(parts) if parts else None


def _short(text: Any, limit: int = 40) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _decoded(path: Path, raw: bytes, foreign_hint: str = "") -> str:
    """``raw`` as text; bytes that are not UTF-8 stay as lone surrogates (the rows holding them
    are skipped as damaged), unless they are in the first line: then it is not a results file."""
    if raw.startswith(b"\xef\xbb\xbf"):  # a byte-order mark, as spreadsheet programs save CSV
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if raw.count(b"\n", 0, exc.start) == 0:
            what = f"byte 0x{raw[exc.start]:02x} at offset {exc.start} is not UTF-8 text"
            raise MegaMoEError(f"{path}: not a megamoe results file ({what}){foreign_hint}") from None
        return raw.decode("utf-8", errors="surrogateescape")


def _not_text(cells: Sequence[str]) -> bool:
    return any("\udc80" <= ch <= "\udcff" for cell in cells for ch in cell)


def _csv_records(path: Path, text: str, foreign_hint: str = "", damage: Optional[Damage] = None) -> tuple:
    """``(header, rows, lines)`` of a CSV results file: every row has the header's number of
    fields; a row that does not (a writer killed mid-row), that is not CSV, or that holds bytes
    that are not text is skipped and noted in ``damage``."""
    damage = damage if damage is not None else Damage(path)
    source = iter(io.StringIO(text, newline=""))
    header: Optional[List[str]] = None
    rows: List[List[str]] = []
    lines: List[int] = []
    consumed = 0  # physical lines the readers took before the current one
    while True:
        reader = csv.reader(source)
        start = consumed + 1
        try:
            for record in reader:
                if header is None:
                    header = record
                    if not set(IDENTITY_COLUMNS) <= set(header):
                        raise MegaMoEError(f"{path}: not a megamoe results file (its first line has no "
                                           f"{'/'.join(IDENTITY_COLUMNS)} columns){foreign_hint}")
                elif not record:
                    pass
                elif len(record) != len(header):
                    damage.row(start, f"{len(record)} fields, the header has {len(header)}")
                elif _not_text(record):
                    damage.row(start, "bytes that are not UTF-8 text")
                elif record == header:
                    damage.row(start, "the header again")
                else:
                    rows.append(record)
                    lines.append(start)
                start = consumed + reader.line_num + 1
        except csv.Error as exc:
            damage.row(consumed + reader.line_num, f"not a CSV row ({exc})")
            consumed += reader.line_num
            continue
        break
    return header or [], rows, lines


def _csv_header(path: Path) -> List[str]:
    with open(path, "rb") as f:
        first = f.readline()
    header, _, _ = _csv_records(path, _decoded(path, first))
    return header


def _jsonl_records(path: Path, text: str, foreign_hint: str = "", damage: Optional[Damage] = None) -> tuple:
    """``(records, lines)`` of a JSON Lines results file; a line that is not a result row is
    skipped and noted in ``damage``, unless no line is one: then it is not a results file."""
    damage = damage if damage is not None else Damage(path)
    records, lines, first = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        first = first or number
        if _not_text([line]):
            damage.row(number, "bytes that are not UTF-8 text")
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deep"
            damage.row(number, f"not JSON ({why})")
            continue
        if not isinstance(record, dict) or not set(IDENTITY_COLUMNS) <= set(record):
            damage.row(number, f"not a result row (no {'/'.join(IDENTITY_COLUMNS)} fields)")
            continue
        records.append(record)
        lines.append(number)
    if first is not None and not records:
        raise MegaMoEError(f"{path}: not a megamoe results file (line {first} is not a JSON object "
                           f"with {'/'.join(IDENTITY_COLUMNS)} fields){foreign_hint}")
    return records, lines


def _check_regular(path: Path, what: str) -> None:
    """A FIFO, a device or a socket given for a file would block or never end: refused by name."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise MegaMoEError(f"{path}: is {kind}; expected a {what} (a regular file)")


def _load(path: Path, foreign_hint: str = "", damage: Optional[Damage] = None):
    """The rows of a results file as a DataFrame of its own columns (and ``_line``, each row's
    line, for CSV and JSON Lines), damaged rows skipped into ``damage``; a file that is not a
    results file is one error naming it."""
    import pandas as pd

    fmt = file_format(path)
    _check_regular(path, "results file")
    damage = damage if damage is not None else Damage(path)
    if fmt == "parquet":
        try:
            frame = pd.read_parquet(path)
        except Exception as exc:  # pyarrow raises its own types for every kind of damage
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise MegaMoEError(f"{path}: not a Parquet file pyarrow can read ({reason}){foreign_hint}") from None
        if not set(IDENTITY_COLUMNS) <= set(frame.columns):
            raise MegaMoEError(f"{path}: not a megamoe results file (no {'/'.join(IDENTITY_COLUMNS)} "
                               f"columns){foreign_hint}")
        return frame
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise MegaMoEError(f"{path}: cannot read the results file ({(exc.strerror or str(exc)).lower()})") from None
    text = _decoded(path, raw, foreign_hint)
    if fmt == "csv":
        header, rows, lines = _csv_records(path, text, foreign_hint, damage)
        if len(set(header)) != len(header):
            raise MegaMoEError(f"{path}: not a megamoe results file (its first line names a column twice)"
                               f"{foreign_hint}")
        frame = pd.DataFrame(rows, columns=header, dtype=object).replace({"": None})
    else:
        records, lines = _jsonl_records(path, text, foreign_hint, damage)
        frame = pd.DataFrame(records)
    frame["_line"] = lines
    return frame


def _append_bytes(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def append_rows(path: Union[str, Path], rows: Sequence[Row]) -> None:
    """Append ``rows`` to the results file at ``path``, creating it if needed."""
    path = Path(path)
    fmt = file_format(path)
    rows = list(rows)
    if not rows:
        return
    for row in rows:
        unknown = sorted(set(row) - set(COLUMNS))
        if unknown:
            raise MegaMoEError(f"row has columns {unknown} that are not in the schema (results.COLUMNS)")
        check_row(row, path)
    try:
        exists = path.exists() and path.stat().st_size > 0
        if fmt == "jsonl":
            prefix = "" if not exists or _ends_with_newline(path) else "\n"
            text = prefix + "".join(row_to_json({k: r.get(k) for k in COLUMNS}) + "\n" for r in rows)
            _append_bytes(path, text.encode())
        elif fmt == "csv":
            _append_csv(path, rows, exists)
        else:
            _append_parquet(path, rows, exists)
    except OSError as exc:
        raise MegaMoEError(f"{path}: cannot write results ({(exc.strerror or str(exc)).lower()})") from None


def _append_csv(path: Path, rows: Sequence[Row], exists: bool) -> None:
    header = _csv_header(path) if exists else list(COLUMNS)
    if not set(COLUMNS) <= set(header):
        _rewrite_csv_with_union(path, header, rows)
        return
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    if exists and not _ends_with_newline(path):
        buf.write("\n")
    if not exists:
        writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([_csv_cell(row.get(k)) for k in header])
    _append_bytes(path, buf.getvalue().encode())


def _rewrite_csv_with_union(path: Path, header: List[str], rows: Sequence[Row]) -> None:
    """An older file with other columns: keep its cells verbatim, add the new columns."""
    _, old, _ = _csv_records(path, _decoded(path, path.read_bytes()))
    columns = header + [c for c in COLUMNS if c not in header]

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(columns)
            for cells in old:
                writer.writerow(cells + [""] * (len(columns) - len(cells)))
            for row in rows:
                writer.writerow([_csv_cell(row.get(c)) for c in columns])

    atomic_write(path, write)


def _append_parquet(path: Path, rows: Sequence[Row], exists: bool) -> None:
    import pandas as pd

    new = _typed(pd.DataFrame([{k: r.get(k) for k in COLUMNS} for r in rows], columns=list(COLUMNS)))
    frame = pd.concat([pd.read_parquet(path), new], ignore_index=True) if exists else new
    atomic_write(path, lambda tmp: frame.to_parquet(tmp, index=False))


def _typed(frame, damage: Optional[Damage] = None):
    """The schema's dtypes; a cell that is not of its column's type (a hand edit, a value no
    64-bit integer holds) reads as missing and is noted in ``damage``."""
    import pandas as pd

    lines = list(frame["_line"]) if "_line" in frame else [None] * len(frame)

    def note(column, bad) -> None:
        if damage is not None:
            for index in [i for i, flag in enumerate(bad) if flag]:
                damage.cell(column, lines[index], frame[column].iloc[index])

    for col in FLOAT_COLUMNS:
        if col in frame:
            values = pd.to_numeric(frame[col], errors="coerce").astype("float64")
            note(col, [math.isnan(v) and not _missing(raw) for v, raw in zip(values, frame[col])])
            frame[col] = values
    for col in INT_COLUMNS:
        if col in frame:
            values = [_to_int(raw) for raw in frame[col]]
            note(col, [v is None and not _missing(raw) for v, raw in zip(values, frame[col])])
            frame[col] = pd.array(values, dtype="Int64")
    for col in BOOL_COLUMNS:
        if col in frame:
            values = [_to_bool(raw) for raw in frame[col]]
            note(col, [v is None and not _missing(raw) for v, raw in zip(values, frame[col])])
            frame[col] = pd.array(values, dtype="boolean")
    for col in frame.columns:
        if col not in FLOAT_COLUMNS + INT_COLUMNS + BOOL_COLUMNS + ("_line",):
            frame[col] = frame[col].map(lambda v: "" if _missing(v) else v if isinstance(v, str) else
                                        json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    return frame


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "") or _is_nan(value)


def _is_nan(value: Any) -> bool:
    """NaN, or pandas' NA / NaT (what typed columns read back from Parquet hold)."""
    if isinstance(value, float):
        return math.isnan(value)
    return type(value).__name__ in ("NAType", "NaTType")


def _to_int(value: Any) -> Optional[int]:
    """An integer cell as an int that 64 bits hold, else None (``12``, ``12.0``; not ``1e30``)."""
    if _missing(value) or isinstance(value, bool):
        return None
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip()
        try:
            number = int(text)
        except ValueError:
            try:
                as_float = float(text)
            except ValueError:
                return None
            if not math.isfinite(as_float) or as_float != int(as_float):
                return None
            number = int(as_float)
    return number if -INT64_MAX - 1 <= number <= INT64_MAX else None


def _to_bool(value: Any) -> Optional[bool]:
    if isinstance(value, bool):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    text = str(value).strip().lower()
    if text in ("true", "1"):
        return True
    if text in ("false", "0"):
        return False
    return None


def read_results(path: Union[str, Path]):
    """All rows of a results file as a DataFrame with the schema's dtypes.  Damaged rows (a row
    cut short, bytes that are not text) are skipped and cells that are not of their column's
    type read as missing; ``frame.attrs["warnings"]`` holds the one line that says so.  A file
    that is not a results file raises ``MegaMoEError`` naming it."""
    path = Path(path)
    file_format(path)
    if not path.exists():
        raise MegaMoEError(f"{path}: results file not found")
    if path.is_dir():
        raise MegaMoEError(f"{path}: is a directory; expected a results file")
    damage = Damage(path)
    frame = _load(path, damage=damage)
    for col in COLUMNS:
        if col not in frame:
            frame[col] = None
    frame = _typed(frame, damage)
    for col, value in ADDED_COLUMNS.items():
        frame[col] = frame[col].fillna(value)
        if isinstance(value, str):  # a text column reads a missing cell as "", not as missing
            frame[col] = frame[col].replace("", value)
    frame = frame.drop(columns=["_line"], errors="ignore").reset_index(drop=True)
    warning = damage.warning()
    frame.attrs["warnings"] = [warning] if warning else []
    return frame


def rows_frame(rows: Iterable[Row]):
    import pandas as pd

    return _typed(pd.DataFrame([{k: r.get(k) for k in COLUMNS} for r in rows], columns=list(COLUMNS)))
