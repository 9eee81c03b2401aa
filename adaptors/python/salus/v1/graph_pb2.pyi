from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_F32: _ClassVar[DType]
    DTYPE_F16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]
    DTYPE_I64: _ClassVar[DType]
    DTYPE_I32: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class TensorRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_ROLE_UNSPECIFIED: _ClassVar[TensorRole]
    TENSOR_ROLE_PARAMETER: _ClassVar[TensorRole]
    TENSOR_ROLE_STATE: _ClassVar[TensorRole]
    TENSOR_ROLE_CONSTANT: _ClassVar[TensorRole]
    TENSOR_ROLE_FEED: _ClassVar[TensorRole]
    TENSOR_ROLE_INTERMEDIATE: _ClassVar[TensorRole]
DTYPE_UNSPECIFIED: DType
DTYPE_F32: DType
DTYPE_F16: DType
DTYPE_BF16: DType
DTYPE_I64: DType
DTYPE_I32: DType
DTYPE_BOOL: DType
TENSOR_ROLE_UNSPECIFIED: TensorRole
TENSOR_ROLE_PARAMETER: TensorRole
TENSOR_ROLE_STATE: TensorRole
TENSOR_ROLE_CONSTANT: TensorRole
TENSOR_ROLE_FEED: TensorRole
TENSOR_ROLE_INTERMEDIATE: TensorRole

class Tensor(_message.Message):
    __slots__ = ("id", "name", "dtype", "shape", "role", "data")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    role: TensorRole
    data: bytes
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., role: _Optional[_Union[TensorRole, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class IntList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...

class FloatList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class BoolList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, values: _Optional[_Iterable[bool]] = ...) -> None: ...

class Attribute(_message.Message):
    __slots__ = ("int", "float", "bool", "string", "ints", "floats", "bools", "dtype")
    INT_FIELD_NUMBER: _ClassVar[int]
    FLOAT_FIELD_NUMBER: _ClassVar[int]
    BOOL_FIELD_NUMBER: _ClassVar[int]
    STRING_FIELD_NUMBER: _ClassVar[int]
    INTS_FIELD_NUMBER: _ClassVar[int]
    FLOATS_FIELD_NUMBER: _ClassVar[int]
    BOOLS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    int: int
    float: float
    bool: bool
    string: str
    ints: IntList
    floats: FloatList
    bools: BoolList
    dtype: DType
    def __init__(self, int: _Optional[int] = ..., float: _Optional[float] = ..., bool: _Optional[bool] = ..., string: _Optional[str] = ..., ints: _Optional[_Union[IntList, _Mapping]] = ..., floats: _Optional[_Union[FloatList, _Mapping]] = ..., bools: _Optional[_Union[BoolList, _Mapping]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "op", "inputs", "outputs", "attributes", "source")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Attribute
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Attribute, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    op: str
    inputs: _containers.RepeatedScalarFieldContainer[int]
    outputs: _containers.RepeatedScalarFieldContainer[int]
    attributes: _containers.MessageMap[str, Attribute]
    source: str
    def __init__(self, name: _Optional[str] = ..., op: _Optional[str] = ..., inputs: _Optional[_Iterable[int]] = ..., outputs: _Optional[_Iterable[int]] = ..., attributes: _Optional[_Mapping[str, Attribute]] = ..., source: _Optional[str] = ...) -> None: ...

class Update(_message.Message):
    __slots__ = ("target", "value")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    target: int
    value: int
    def __init__(self, target: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...

class Graph(_message.Message):
    __slots__ = ("version", "tensors", "nodes", "fetches", "updates", "precision")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    fetches: _containers.RepeatedScalarFieldContainer[int]
    updates: _containers.RepeatedCompositeFieldContainer[Update]
    precision: Precision
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., fetches: _Optional[_Iterable[int]] = ..., updates: _Optional[_Iterable[_Union[Update, _Mapping]]] = ..., precision: _Optional[_Union[Precision, _Mapping]] = ...) -> None: ...

class Precision(_message.Message):
    __slots__ = ("conv_allow_tf32", "matmul_allow_tf32")
    CONV_ALLOW_TF32_FIELD_NUMBER: _ClassVar[int]
    MATMUL_ALLOW_TF32_FIELD_NUMBER: _ClassVar[int]
    conv_allow_tf32: bool
    matmul_allow_tf32: bool
    def __init__(self, conv_allow_tf32: _Optional[bool] = ..., matmul_allow_tf32: _Optional[bool] = ...) -> None: ...
