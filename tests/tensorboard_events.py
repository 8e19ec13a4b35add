"""Reading TensorBoard event files back, for tests/training/test_metrics.py and
test_trackers.py."""

import struct

from tensorboardX.proto import event_pb2


def _read_events(directory):
    """Scalars from TensorBoard event files (TFRecord: u64 length, u32 crc, data, u32 crc)."""
    scalars = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.append((event.step, value.tag, value.simple_value))
    return scalars
