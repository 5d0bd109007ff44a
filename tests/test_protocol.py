"""The op table that server and SDK share matches the proto."""

from gradserve.protocol import BATCH_FIELDS
from gradserve.server.transport.handlers import OPS
from gradserve.v1 import service_pb2


def test_batch_fields_cover_every_op_rpc():
    service = service_pb2.DESCRIPTOR.services_by_name["GradServe"]
    step_fields = service_pb2.BatchStep.DESCRIPTOR.oneofs_by_name["op"].fields
    result_fields = service_pb2.BatchResult.DESCRIPTOR.oneofs_by_name["op"].fields
    for rpc, field in BATCH_FIELDS.items():
        method = service.methods_by_name[rpc]
        step = service_pb2.BatchStep.DESCRIPTOR.fields_by_name[field]
        result = service_pb2.BatchResult.DESCRIPTOR.fields_by_name[field]
        assert step.message_type is method.input_type
        assert result.message_type is method.output_type
    assert {f.name for f in step_fields} == set(BATCH_FIELDS.values())
    assert {f.name for f in result_fields} == set(BATCH_FIELDS.values())
    assert {op.rpc for op in OPS} == set(BATCH_FIELDS)
