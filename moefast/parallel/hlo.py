"""The collectives of a compiled XLA program: what is exchanged, how much, and what waits on what.

Reads the HLO text of a compiled module (``jax.jit(f).lower(...).compile().as_text()``, or
``Trainer.compiled_train_step().as_text()``): the program after XLA's optimisation passes, so it
shows the collectives XLA really runs (after combining or decomposing them), in schedule order when
the module is scheduled (``is_scheduled=true``, as on GPU). The program XLA is given
(``lowered.as_text(dialect="hlo")``) reads the same way.

* :func:`collectives` lists every collective with its kind, shape and bytes and, for asynchronous
  ones (``*-start`` / ``*-done`` pairs, or ``async-start`` / ``async-done`` wrapping one), how many
  compute instructions are scheduled between the start and the done.
* :func:`depends_on` walks the operands: whether one instruction (transitively) uses another's
  result. ``moefast bench overlap`` and the tests use it to show that the chunks of the expert
  exchange are independent chains (``moe.overlap_chunks``).
"""

from __future__ import annotations

import dataclasses
import re
from functools import cached_property

__all__ = ["COLLECTIVE_KINDS", "Collective", "HloModule", "collectives", "depends_on", "format_collectives",
           "split_type"]

COLLECTIVE_KINDS = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                    "ragged-all-to-all", "collective-broadcast")

_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
          "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([^\s({]+)\s*(?:\(.*)?\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
# Opcodes that are not compute for "what runs between an async start and its done".
_NOT_COMPUTE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy-start", "copy-done",
                "after-all", "partition-id", "replica-id", "opt-barrier", "optimization-barrier"}


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    opcode: str
    shape: str  # the result type as printed, e.g. "f32[4,8]{1,0}" or a tuple "(f32[2], s32[])"
    operands: tuple[str, ...]
    calls: tuple[str, ...]  # computations it applies (fusion bodies, async/call targets)
    computation: str
    index: int  # position in its computation (schedule order in a scheduled module)
    is_sync: bool = False  # XLA:GPU marked this async pair synchronous (``"is_sync":true``)
    op_name: str = ""  # the JAX operation it comes from (``metadata={op_name=...}``)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled module.

    Attributes:
      name: HLO instruction name (the ``*-done`` of an asynchronous pair is not listed separately).
      kind: one of :data:`COLLECTIVE_KINDS`.
      shape: result type as printed by XLA.
      bytes: bytes of the result (all arrays of a tuple result; for an async start, of the done's
        result).
      is_async: an asynchronous start/done pair that XLA did not mark synchronous (``"is_sync":true``
        in the start's backend config, which XLA:GPU sets when nothing can overlap it).
      compute_between: compute instructions (fusions, dots, custom calls, ...) scheduled between
        the start and the done of an asynchronous pair; 0 for a synchronous collective.
      computation: the HLO computation it is in.
      op_name: the JAX operation it comes from (e.g. ``.../shard_map/all_to_all`` for the expert
        exchange; the partitioner's own collectives carry the operation they partition).
    """

    name: str
    kind: str
    shape: str
    bytes: int
    is_async: bool
    compute_between: int
    computation: str
    op_name: str = ""


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO type string (``f32[4,8]{1,0}`` -> 128; tuples summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return total


def split_type(rest: str) -> tuple[str, str]:
    """``"f32[2]{0} add(%a, %b), ..."`` -> (type, remainder starting at the opcode)."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == " " and depth == 0:
            return rest[:i], rest[i:]
    return rest, ""


def _operand_list(rest: str) -> str:
    """The text inside the opcode's parentheses."""
    start = rest.index("(")
    depth = 0
    for i in range(start, len(rest)):
        if rest[i] == "(":
            depth += 1
        elif rest[i] == ")":
            depth -= 1
            if depth == 0:
                return rest[start + 1:i]
    return rest[start + 1:]


def _operand_names(text: str) -> tuple[str, ...]:
    """Operand names of an operand list, with (``%a, %b``) or without (``a, f32[2] b``) sigils."""
    if "%" in text:
        return tuple(re.findall(r"%([\w.\-]+)", text))
    names, depth, piece = [], 0, ""
    for ch in text + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            token = piece.strip().split(" ")[-1] if piece.strip() else ""
            if re.fullmatch(r"[A-Za-z_][\w.\-]*", token):
                names.append(token)
            piece = ""
        else:
            piece += ch
    return tuple(names)


class HloModule:
    """A parsed module: instructions by name and per computation, in printed order."""

    def __init__(self, text: str):
        self.instrs: dict[str, Instr] = {}
        self.computations: dict[str, list[str]] = {}
        self.entry: str | None = None
        comp = None
        for line in text.splitlines():
            if not line.startswith(" "):
                head = _COMP_HEAD.match(line)
                comp = head.group(2) if head else None
                if comp is not None:
                    self.computations[comp] = []
                    if head.group(1):
                        self.entry = comp
                continue
            m = _INSTR.match(line)
            if comp is None or not m:
                continue
            shape, rest = split_type(m.group(2))
            op = _OPCODE.match(rest)
            if not op:
                continue
            operands = _operand_names(_operand_list(rest))
            calls = tuple(re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", rest))
            name = m.group(1)
            op_name = re.search(r'op_name="([^"]*)"', rest)
            self.instrs[name] = Instr(name, op.group(1), shape, operands, calls, comp,
                                      len(self.computations[comp]), '"is_sync":true' in rest,
                                      op_name.group(1) if op_name else "")
            self.computations[comp].append(name)

    @cached_property
    def _users_of_async(self) -> dict[str, str]:
        """async start name -> its done's name."""
        done = {}
        for ins in self.instrs.values():
            if ins.opcode.endswith("-done") and ins.operands:
                done[ins.operands[0]] = ins.name
        return done

    def _wrapped_kind(self, ins: Instr) -> str | None:
        """Kind of the collective an instruction is, or starts (``async-start`` wrapping one)."""
        base = ins.opcode[:-len("-start")] if ins.opcode.endswith("-start") else ins.opcode
        if base in COLLECTIVE_KINDS:
            return base
        if ins.opcode == "async-start":
            for comp in ins.calls:
                for name in self.computations.get(comp, []):
                    if self.instrs[name].opcode in COLLECTIVE_KINDS:
                        return self.instrs[name].opcode
        return None

    def collectives(self) -> list[Collective]:
        out = []
        for comp, names in self.computations.items():
            if comp.startswith("async") and comp != self.entry and any(
                    comp in i.calls for i in self.instrs.values() if i.opcode == "async-start"):
                continue  # the body of an async-start: listed as the start
            for name in names:
                ins = self.instrs[name]
                kind = self._wrapped_kind(ins)
                if kind is None:
                    continue
                # XLA:GPU keeps a start/done pair for a collective it runs synchronously (nothing to
                # overlap it with) and says so in the start's backend config.
                is_async = ins.opcode.endswith("-start") and not ins.is_sync
                shape, between = ins.shape, 0
                if ins.opcode.endswith("-start") and name in self._users_of_async:
                    done = self.instrs[self._users_of_async[name]]
                    shape = done.shape
                    if is_async and done.computation == comp:
                        between = sum(self.instrs[n].opcode not in _NOT_COMPUTE and self._wrapped_kind(self.instrs[n]) is None
                                      and not self.instrs[n].opcode.endswith("-done")
                                      for n in names[ins.index + 1:done.index])
                out.append(Collective(name, kind, shape, shape_bytes(shape), is_async, between, comp, ins.op_name))
        return out

    def depends_on(self, a: str, b: str) -> bool:
        """Whether instruction ``a`` uses ``b``'s result, directly or through other instructions
        of its computation."""
        seen, stack = set(), [a]
        while stack:
            name = stack.pop()
            for op in self.instrs[name].operands:
                if op == b:
                    return True
                if op not in seen and op in self.instrs:
                    seen.add(op)
                    stack.append(op)
        return False


    def dependencies(self, names: list[str]) -> dict[str, set[str]]:
        """For each of ``names``, the others of ``names`` it (transitively) uses, within its
        computation: one pass in printed order (HLO prints an instruction after its operands), for
        many instructions at once (e.g. every all-to-all of a train step)."""
        wanted = set(names)
        reach: dict[str, frozenset[str]] = {}
        for comp_names in self.computations.values():
            for n in comp_names:
                acc: set[str] = set()
                for o in self.instrs[n].operands:
                    acc |= reach.get(o, frozenset())
                    if o in wanted:
                        acc.add(o)
                reach[n] = frozenset(acc)
        return {n: set(reach.get(n, frozenset())) - {n} for n in names}


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled module's text, in printed (schedule) order per computation."""
    return HloModule(hlo_text).collectives()


def depends_on(hlo_text: str, a: str, b: str) -> bool:
    """Whether instruction ``a`` of the module (transitively) uses instruction ``b``."""
    return HloModule(hlo_text).depends_on(a, b)


def format_collectives(items: list[Collective]) -> str:
    """A markdown table of :func:`collectives`."""
    lines = ["| collective | kind | shape | bytes | async | compute ops between start and done |",
             "|---|---|---|---:|---|---:|"]
    for c in items:
        lines.append(f"| {c.name} | {c.kind} | `{c.shape}` | {c.bytes:,} | {'yes' if c.is_async else 'no'} | "
                     f"{c.compute_between if c.is_async else '—'} |")
    return "\n".join(lines)
