"""Trim an XLA schedule dump to the fields jax_drain.planner.timing reads (for a test fixture).

    python tests/data/trim_schedule_dump.py DUMP_DIR/jit_wrapped.schedule.txt | gzip -9 > tests/data/NAME.schedule.txt.gz

Blocks other than the module, its computations and instructions, and the schedules are dropped,
and so are the fields the reader does not use (shapes, metadata, layouts): what stays is XLA's
own text, line for line.
"""

import re
import sys

BLOCKS = {"hlo_module", "computations", "instructions", "computation_schedules", "scheduler_statistics"}
FIELDS = re.compile(r"^(name|opcode|id|operand_ids|called_computation_ids|backend_config|entry_computation_id|"
                    r"computation_id|start_timestamp_cycles|end_timestamp_cycles|\w+_wasted_cycles|total_cycles|"
                    r"cycles_per_microsecond)\s*:")


def trim(lines):
    skipping = 0
    for line in lines:
        text = line.strip()
        if skipping:
            skipping += text.endswith("{") - (text == "}")
            continue
        if text.endswith("{"):
            if text[:-1].strip() in BLOCKS:
                yield line
            else:
                skipping = 1
        elif text == "}" or FIELDS.match(text):
            yield line


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.stdout.writelines(trim(f))
