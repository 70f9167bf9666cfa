"""ResourceSlice validation as the API server does it, for the API-server stand-in.

Written from kubernetes/kubernetes pkg/apis/resource/validation/validation.go
(ValidateResourceSlice / ValidateResourceSliceUpdate, validateResourceSliceSpec,
validateResourcePool, validatePoolName, validateDevice, validateQualifiedName,
validateCIdentifier, validateDeviceAttribute, validateDeviceTaint, validateSet/validateMap)
and the limits in staging/src/k8s.io/api/resource/v1/types.go (ResourceSliceMaxDevices 128,
ResourceSliceMaxDevicesWithAdvancedFeatures 64 once a device has taints, counters or list
attributes, DriverNameMaxLength 63, PoolNameMaxLength 253, DeviceMaxIDLength 32,
DeviceAttributeMaxValueLength 64, ResourceSliceMaxAttributesAndCapacitiesPerDevice 32,
DeviceTaintsMaxLength 16). Error texts follow apimachinery's field.Error strings, because that
is what an operator reads in our logs for a 422.

It follows validation.go function by function.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64
DRIVER_NAME_MAX = 63
POOL_NAME_MAX = 253
C_IDENTIFIER_MAX = 32
ATTRIBUTE_VALUE_MAX = 64
ATTRIBUTES_AND_CAPACITIES_MAX = 32
TAINTS_MAX = 16
COUNTER_SETS_MAX = 8
COUNTERS_MAX = 32
CONSUMPTIONS_MAX = 2
TAINT_EFFECTS = ("NoExecute", "NoSchedule", "None")

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_QUALIFIED_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
_NUM = r"(0|[1-9]\d*)"
_PRE = r"(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
_BUILD = r"[0-9a-zA-Z-]+"
_SEMVER = re.compile(rf"{_NUM}\.{_NUM}\.{_NUM}(-{_PRE}(\.{_PRE})*)?(\+{_BUILD}(\.{_BUILD})*)?\Z")
# apimachinery resource.Quantity: <signedNumber><suffix>, suffix binary SI, decimal SI or e<n>.
_QUANTITY = re.compile(
    r"[+-]?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?\Z")

LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or "
             "'-', and must start and end with an alphanumeric character (e.g. 'my-name',  or "
             "'123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                 "characters, '-' or '.', and must start and end with an alphanumeric character "
                 "(e.g. 'example.com', regex used for validation is "
                 "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
C_IDENTIFIER_MSG = ("a valid C identifier must start with alphabetic character or '_', "
                    "followed by a string of alphanumeric characters or '_' (e.g. 'my_name',  "
                    "or 'MY_NAME',  or 'MyName', regex used for validation is "
                    "'[A-Za-z_][A-Za-z0-9_]*')")


class DecodeError(Exception):
    """What the API server answers 400 for: a body that does not decode into the type."""


@dataclass
class FieldError:
    """apimachinery field.Error: its String() is what the Status message carries."""

    kind: str  # FieldValueInvalid, FieldValueRequired, ...
    field: str
    detail: str = ""
    value: Any = None
    has_value: bool = True

    def body(self) -> str:
        if self.kind == "FieldValueInvalid":
            head = f"Invalid value: {_value_text(self.value)}"
        elif self.kind == "FieldValueRequired":
            head = "Required value"
        elif self.kind == "FieldValueDuplicate":
            head = f"Duplicate value: {_value_text(self.value)}"
        elif self.kind == "FieldValueTooLong":
            head = "Too long"
        elif self.kind == "FieldValueTooMany":
            head = "Too many"
        elif self.kind == "FieldValueNotSupported":
            head = f"Unsupported value: {_value_text(self.value)}"
        elif self.kind == "FieldValueForbidden":
            head = "Forbidden"
        else:
            head = "Internal error"
        return f"{head}: {self.detail}" if self.detail else head

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def _value_text(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def _invalid(field: str, value: Any, detail: str) -> FieldError:
    return FieldError("FieldValueInvalid", field, detail, value)


def _required(field: str, detail: str = "") -> FieldError:
    return FieldError("FieldValueRequired", field, detail)


def _too_long(field: str, limit: int) -> FieldError:
    return FieldError("FieldValueTooLong", field, f"may not be more than {limit} bytes")


def dns_label_errors(name: str, field: str) -> List[FieldError]:
    errs = []
    if len(name) > 63:
        errs.append(_invalid(field, name, "must be no more than 63 characters"))
    if not _LABEL.match(name):
        errs.append(_invalid(field, name, LABEL_MSG))
    return errs


def dns_subdomain_errors(name: str, field: str, limit: int = 253) -> List[FieldError]:
    errs = []
    if len(name) > limit:
        errs.append(_invalid(field, name, f"must be no more than {limit} characters"))
    if not _SUBDOMAIN.match(name):
        errs.append(_invalid(field, name, SUBDOMAIN_MSG))
    return errs


def driver_name_errors(name: Any, field: str) -> List[FieldError]:
    """corevalidation.ValidateCSIDriverName: required, <= 63, a DNS subdomain once lowered."""
    if not name:
        return [_required(field)]
    errs = []
    if len(name) > DRIVER_NAME_MAX:
        errs.append(_too_long(field, DRIVER_NAME_MAX))
    if not _SUBDOMAIN.match(name.lower()):
        errs.append(_invalid(field, name, SUBDOMAIN_MSG))
    return errs


def pool_name_errors(name: str, field: str) -> List[FieldError]:
    if not name:
        return [_required(field)]
    errs = []
    if len(name) > POOL_NAME_MAX:
        errs.append(_too_long(field, POOL_NAME_MAX))
    for part in name.split("/"):
        errs.extend(dns_subdomain_errors(part, field))
    return errs


def c_identifier_errors(name: str, field: str) -> List[FieldError]:
    errs = []
    if len(name) > C_IDENTIFIER_MAX:
        errs.append(_too_long(field, C_IDENTIFIER_MAX))
    if not _C_IDENTIFIER.match(name):
        errs.append(_invalid(field, name, C_IDENTIFIER_MSG))
    return errs


def qualified_name_errors(name: str, field: str) -> List[FieldError]:
    """validateQualifiedName: a C identifier, optionally "<driver-like domain>/" before it."""
    parts = name.split("/")
    if len(parts) == 1:
        return c_identifier_errors(parts[0], field)
    if len(parts) == 2:
        errs: List[FieldError] = []
        if not parts[0]:
            errs.append(_invalid(field, "", "the domain must not be empty"))
        else:
            errs.extend(driver_name_errors(parts[0], field))
        if not parts[1]:
            errs.append(_invalid(field, "", "the name must not be empty"))
        else:
            errs.extend(c_identifier_errors(parts[1], field))
        return errs
    return [_invalid(field, name, "must not contain more than one slash")]


def label_name_errors(key: str, field: str) -> List[FieldError]:
    """metav1validation.ValidateLabelName (IsQualifiedName): [prefix/]name, name <= 63."""
    if not key:
        return [_invalid(field, key, "name part must be non-empty")]
    parts = key.split("/")
    if len(parts) > 2:
        return [_invalid(field, key, "a qualified name must consist of alphanumeric characters,"
                         " '-', '_' or '.', and must start and end with an alphanumeric "
                         "character, with an optional DNS subdomain prefix and '/'")]
    errs = []
    name = parts[-1]
    if len(parts) == 2:
        if not parts[0]:
            errs.append(_invalid(field, key, "prefix part must be non-empty"))
        else:
            errs.extend(_invalid(field, key, f"prefix part {e.detail}")
                        for e in dns_subdomain_errors(parts[0], field))
    if not name:
        errs.append(_invalid(field, key, "name part must be non-empty"))
    elif len(name) > 63:
        errs.append(_invalid(field, key, "name part must be no more than 63 characters"))
    elif not _QUALIFIED_NAME_PART.match(name):
        errs.append(_invalid(field, key, "name part must consist of alphanumeric characters, "
                             "'-', '_' or '.', and must start and end with an alphanumeric "
                             "character"))
    return errs


def _attribute_errors(value: Dict[str, Any], field: str) -> List[FieldError]:
    errs: List[FieldError] = []
    present = [k for k in ("int", "bool", "string", "version") if value.get(k) is not None]
    # Go's len: bytes of the UTF-8 text, not characters.
    if "string" in present and len(value["string"].encode("utf-8", "surrogatepass")) > \
            ATTRIBUTE_VALUE_MAX:
        errs.append(_too_long(f"{field}.string", ATTRIBUTE_VALUE_MAX))
    if "version" in present:
        version = value["version"]
        if not _SEMVER.match(version):
            errs.append(_invalid(f"{field}.version", version,
                                 "must be a string compatible with semver.org spec 2.0.0"))
        if len(version) > ATTRIBUTE_VALUE_MAX:
            errs.append(_too_long(f"{field}.version", ATTRIBUTE_VALUE_MAX))
    if not present:
        errs.append(_invalid(field, "", "exactly one value must be specified"))
    elif len(present) > 1:
        errs.append(_invalid(field, {k: value[k] for k in present},
                             "exactly one value must be specified"))
    return errs


def _decode_attribute(value: Any, field: str) -> Dict[str, Any]:
    """The Go decoder's type checks: a wrong JSON type fails the whole request with 400."""
    if not isinstance(value, dict):
        raise DecodeError(f"{field}: expected an object")
    types = {"int": int, "bool": bool, "string": str, "version": str}
    out = {}
    for key, item in value.items():
        if key not in types:
            continue  # unknown fields are dropped (fieldValidation=Warn is the default)
        if item is None:
            continue
        expected = types[key]
        if expected is int and (isinstance(item, bool) or not isinstance(item, int)):
            raise DecodeError(f"{field}.{key}: cannot unmarshal {type(item).__name__} into int64")
        if expected is int and not -(2 ** 63) <= item < 2 ** 63:
            raise DecodeError(f"{field}.{key}: value out of range of int64")
        if expected is not int and not isinstance(item, expected):
            raise DecodeError(f"{field}.{key}: cannot unmarshal {type(item).__name__} "
                              f"into {expected.__name__}")
        out[key] = item
    return out


_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
           "Ei": 1 << 60}
_DECIMAL = {"": 1, "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15,
            "E": 10 ** 18}
_INTEGER_QUANTITY = re.compile(r"([+-]?\d+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?\Z")


def canonical_quantity(text: Any) -> Any:
    """What the API server stores for a quantity: resource.Quantity decodes it and writes
    its canonical form back (apimachinery quantity.go CanonicalizeBytes): "1000" is "1k",
    "2048Ki" is "2Mi", "1536" stays. The format is kept from the input (binary suffix:
    BinarySI, else DecimalSI); a binary value under 1024 or not a whole multiple of 1Ki is
    written in DecimalSI. Whole numbers only (what drivers report); others are kept as sent.
    """
    match = _INTEGER_QUANTITY.match(str(text))
    if not match:
        return text
    suffix = match.group(2) or ""
    value = int(match.group(1)) * (_BINARY.get(suffix) or _DECIMAL[suffix])
    if suffix in _BINARY and abs(value) >= 1024:
        for name, scale in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
            if value % scale == 0:
                return f"{value // scale}{name}"
    if value == 0:
        return "0"
    for name, scale in sorted(_DECIMAL.items(), key=lambda kv: -kv[1]):
        if value % scale == 0:
            return f"{value // scale}{name}"
    return str(value)


def canonicalize_quantities(obj: Dict[str, Any]) -> None:
    """Every device capacity value of a ResourceSlice in its stored (canonical) form."""
    for device in (obj.get("spec") or {}).get("devices") or []:
        if not isinstance(device, dict):
            continue
        for capacity in (device.get("capacity") or {}).values():
            if isinstance(capacity, dict) and "value" in capacity:
                capacity["value"] = canonical_quantity(capacity["value"])
            policy = capacity.get("requestPolicy") if isinstance(capacity, dict) else None
            if isinstance(policy, dict):
                if "default" in policy:
                    policy["default"] = canonical_quantity(policy["default"])
                if isinstance(policy.get("validValues"), list):
                    policy["validValues"] = [canonical_quantity(v)
                                             for v in policy["validValues"]]
                if isinstance(policy.get("validRange"), dict):
                    for key, value in list(policy["validRange"].items()):
                        policy["validRange"][key] = canonical_quantity(value)


def _capacity_errors(value: Any, field: str, multi: bool) -> List[FieldError]:
    if not isinstance(value, dict):
        raise DecodeError(f"{field}: expected an object")
    quantity = value.get("value")
    if not isinstance(quantity, (str, int)) or isinstance(quantity, bool) or \
            not _QUANTITY.match(str(quantity)):
        raise DecodeError(f"{field}.value: quantities must match the regular expression "
                          "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
    policy = value.get("requestPolicy")
    if policy is not None and not multi:
        return [FieldError("FieldValueForbidden", f"{field}.requestPolicy",
                           "allowMultipleAllocations must be true")]
    if policy is not None:
        return _request_policy_errors(policy, _amount(quantity), f"{field}.requestPolicy")
    return []


def _amount(text: Any) -> int:
    """A whole quantity's value (what requestPolicy checks compare); 0 where it is not one."""
    match = _INTEGER_QUANTITY.match(str(canonical_quantity(text)))
    if not match:
        return 0
    suffix = match.group(2) or ""
    return int(match.group(1)) * (_BINARY.get(suffix) or _DECIMAL[suffix])


def _request_policy_errors(policy: Any, maximum: int, field: str) -> List[FieldError]:
    """validateRequestPolicy: one of validValues / validRange; a default that fits it."""
    if not isinstance(policy, dict):
        raise DecodeError(f"{field}: expected an object")
    values, valid_range = policy.get("validValues") or [], policy.get("validRange")
    if values and valid_range is not None:
        return [FieldError("FieldValueForbidden", field, 'exactly one policy can be specified, '
                           'cannot specify "validValues" and "validRange" at the same time')]
    default = policy.get("default")
    if (values or valid_range is not None) and default is None:
        what = "validValues" if values else "validRange"
        return [_required(f"{field}.default", f"required when {what} is defined")]
    errs: List[FieldError] = []
    if values:
        amounts = [_amount(v) for v in values]
        if amounts != sorted(amounts):
            errs.append(_invalid(f"{field}.validValues", values,
                                 "values must be sorted in ascending order"))
        if any(a > maximum for a in amounts):
            errs.append(_invalid(f"{field}.validValues", values,
                                 "option is larger than capacity value"))
        if _amount(default) not in amounts:
            errs.append(_invalid(f"{field}.validValues", default,
                                 "default value is not valid according to the requestPolicy"))
    elif isinstance(valid_range, dict):
        if valid_range.get("min") is None:
            return [_required(f"{field}.validRange.min", "required when validRange is defined")]
        low, fallback = _amount(valid_range["min"]), _amount(default)
        high = _amount(valid_range["max"]) if valid_range.get("max") is not None else None
        if low > maximum:
            errs.append(_invalid(f"{field}.validRange.min", valid_range["min"],
                                 "min is larger than capacity value"))
        if fallback < low:
            errs.append(_invalid(f"{field}.validRange.min", default, "default is less than min"))
        if high is not None and (high > maximum or low > high or fallback > high):
            errs.append(_invalid(f"{field}.validRange.max", valid_range["max"],
                                 "max is larger than capacity value, less than min or less "
                                 "than default"))
        step = valid_range.get("step")
        if step is not None and _amount(step) > 0 and (fallback - low) % _amount(step):
            errs.append(_invalid(f"{field}.validRange.step", default,
                                 "value is not a multiple of a given step"))
    return errs


def _taint_errors(taint: Any, field: str) -> List[FieldError]:
    if not isinstance(taint, dict):
        raise DecodeError(f"{field}: expected an object")
    errs = label_name_errors(str(taint.get("key") or ""), f"{field}.key")
    value = taint.get("value") or ""
    if value:
        if len(value) > 63:
            errs.append(_invalid(f"{field}.value", value, "must be no more than 63 characters"))
        if not _LABEL_VALUE.match(value):
            errs.append(_invalid(f"{field}.value", value,
                                 "a valid label must be an empty string or consist of "
                                 "alphanumeric characters, '-', '_' or '.', and must start "
                                 "and end with an alphanumeric character"))
    effect = taint.get("effect") or ""
    if not effect:
        errs.append(_required(f"{field}.effect"))
    elif effect not in TAINT_EFFECTS:
        errs.append(FieldError("FieldValueNotSupported", f"{field}.effect",
                               "supported values: " + ", ".join(f'"{e}"'
                                                                for e in TAINT_EFFECTS),
                               effect))
    return errs


def _counters_errors(counters: Any, field: str) -> List[FieldError]:
    if not isinstance(counters, dict):
        raise DecodeError(f"{field}: expected an object")
    errs: List[FieldError] = []
    if len(counters) > COUNTERS_MAX:
        errs.append(FieldError("FieldValueTooMany", field,
                               f"{len(counters)}: must have at most {COUNTERS_MAX} items"))
    for name, counter in counters.items():
        errs.extend(dns_label_errors(str(name), f"{field}[{name}]"))
        value = counter.get("value") if isinstance(counter, dict) else None
        if value is None or not _QUANTITY.match(str(value)):
            errs.append(_required(f"{field}[{name}].value"))
    return errs


def _counter_set_errors(sets: Any) -> List[FieldError]:
    """spec.sharedCounters (validateCounterSet): at most 8 sets of at most 32 counters, names
    DNS labels, unique."""
    if not isinstance(sets, list):
        raise DecodeError("spec.sharedCounters: expected an array")
    errs: List[FieldError] = []
    if len(sets) > COUNTER_SETS_MAX:
        errs.append(FieldError("FieldValueTooMany", "spec.sharedCounters",
                               f"{len(sets)}: must have at most {COUNTER_SETS_MAX} items"))
    seen = set()
    for i, counter_set in enumerate(sets):
        field = f"spec.sharedCounters[{i}]"
        name = str((counter_set or {}).get("name") or "")
        errs.extend(dns_label_errors(name, f"{field}.name") if name
                    else [_required(f"{field}.name")])
        if name in seen:
            errs.append(FieldError("FieldValueDuplicate", field, "", name))
        seen.add(name)
        errs.extend(_counters_errors((counter_set or {}).get("counters") or {},
                                     f"{field}.counters"))
    return errs


def _device_errors(device: Dict[str, Any], old: Optional[Dict[str, Any]],
                   field: str) -> List[FieldError]:
    errs = dns_label_errors(str(device.get("name") or ""), f"{field}.name") \
        if device.get("name") else [_required(f"{field}.name")]
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if not isinstance(attributes, dict) or not isinstance(capacity, dict):
        raise DecodeError(f"{field}: attributes and capacity must be objects")
    total = len(attributes) + len(capacity)
    if total > ATTRIBUTES_AND_CAPACITIES_MAX:
        errs.append(_invalid(field, total, "the total number of attributes and capacities "
                             f"must not exceed {ATTRIBUTES_AND_CAPACITIES_MAX}"))
    for key, value in attributes.items():
        errs.extend(qualified_name_errors(key, f"{field}.attributes"))
        errs.extend(_attribute_errors(_decode_attribute(value, f"{field}.attributes[{key}]"),
                                      f"{field}.attributes[{key}]"))
    multi = bool(device.get("allowMultipleAllocations"))
    if old is None or old.get("capacity") != device.get("capacity"):
        for key, value in capacity.items():
            errs.extend(qualified_name_errors(key, f"{field}.capacity"))
            errs.extend(_capacity_errors(value, f"{field}.capacity[{key}]", multi))
    taints = device.get("taints") or []
    if old is None or old.get("taints") != device.get("taints"):
        if len(taints) > TAINTS_MAX:
            errs.append(FieldError("FieldValueTooMany", f"{field}.taints",
                                   f"{len(taints)}: must have at most {TAINTS_MAX} items"))
        else:
            for i, taint in enumerate(taints):
                errs.extend(_taint_errors(taint, f"{field}.taints[{i}]"))
    consumes = device.get("consumesCounters") or []
    if len(consumes) > CONSUMPTIONS_MAX:
        errs.append(FieldError("FieldValueTooMany", f"{field}.consumesCounters",
                               f"{len(consumes)}: must have at most {CONSUMPTIONS_MAX} items"))
    for i, consumption in enumerate(consumes):
        where = f"{field}.consumesCounters[{i}]"
        set_name = str((consumption or {}).get("counterSet") or "")
        errs.extend(dns_label_errors(set_name, f"{where}.counterSet") if set_name
                    else [_required(f"{where}.counterSet")])
        errs.extend(_counters_errors((consumption or {}).get("counters") or {},
                                     f"{where}.counters"))
    for key in ("nodeName", "nodeSelector", "allNodes"):
        if device.get(key) is not None:
            errs.append(_invalid(field, None, "`nodeName`, `nodeSelector` and `allNodes` can "
                                 "only be set if `perDeviceNodeSelection` is set to true in "
                                 "the ResourceSlice spec"))
            break
    return errs


def _int_field(spec: Dict[str, Any], key: str, field: str) -> int:
    value = spec.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"{field}: cannot unmarshal {type(value).__name__} into int64")
    return value


def metadata_errors(meta: Dict[str, Any], for_create: bool) -> List[FieldError]:
    errs: List[FieldError] = []
    name = meta.get("name") or ""
    generate = meta.get("generateName") or ""
    if not name and not generate:
        errs.append(_required("metadata.name", "name or generateName is required"))
    elif name:
        errs.extend(dns_subdomain_errors(name, "metadata.name"))
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        for key in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(key):
                errs.append(_invalid(f"metadata.ownerReferences[{i}].{key}", ref.get(key, ""),
                                     f"{key} must not be empty"))
    return errs


def resource_slice_errors(obj: Dict[str, Any],
                          old: Optional[Dict[str, Any]] = None) -> List[FieldError]:
    """ValidateResourceSlice (old None) or ValidateResourceSliceUpdate; [] when valid.

    Raises DecodeError for what the real server rejects before validation (400).
    """
    meta = obj.get("metadata") or {}
    errs = metadata_errors(meta, old is None)
    if old is not None:
        old_meta = old.get("metadata") or {}
        if meta.get("uid") and meta.get("uid") != old_meta.get("uid"):
            errs.append(_invalid("metadata.uid", meta.get("uid"), "field is immutable"))
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        spec = {}
    old_spec = (old or {}).get("spec") or {}
    errs.extend(driver_name_errors(spec.get("driver"), "spec.driver"))
    pool = spec.get("pool")
    if not isinstance(pool, dict):
        pool = {}
    errs.extend(pool_name_errors(str(pool.get("name") or ""), "spec.pool.name"))
    count = _int_field(pool, "resourceSliceCount", "spec.pool.resourceSliceCount")
    if count <= 0:
        errs.append(_invalid("spec.pool.resourceSliceCount", count, "must be greater than zero"))
    generation = _int_field(pool, "generation", "spec.pool.generation")
    if generation < 0:
        errs.append(_invalid("spec.pool.generation", generation,
                             "must be greater than or equal to zero"))
    if old is not None:
        for path, new_value, old_value in (
                ("spec.pool.name", pool.get("name"), (old_spec.get("pool") or {}).get("name")),
                ("spec.driver", spec.get("driver"), old_spec.get("driver")),
                ("spec.nodeName", spec.get("nodeName"), old_spec.get("nodeName"))):
            if new_value != old_value:
                errs.append(_invalid(path, new_value, "field is immutable"))
    set_fields = []
    node_name = spec.get("nodeName")
    if node_name is not None:
        if node_name:
            set_fields.append("`nodeName`")
            errs.extend(dns_subdomain_errors(node_name, "spec.nodeName"))
        else:
            errs.append(_invalid("spec.nodeName", node_name,
                                 "must be either unset or set to a non-empty string"))
    if spec.get("nodeSelector") is not None:
        set_fields.append("`nodeSelector`")
    for key in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(key) is not None:
            if spec[key] is True:
                set_fields.append(f"`{key}`")
            else:
                errs.append(_invalid(f"spec.{key}", spec[key],
                                     "must be either unset or set to true"))
    if not set_fields:
        errs.append(_required("spec", "exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                              "`perDeviceNodeSelection` is required"))
    elif len(set_fields) > 1:
        errs.append(_invalid("spec", "{" + ", ".join(set_fields) + "}",
                             "exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                             "`perDeviceNodeSelection` is required, but multiple fields are set"))
    devices = spec.get("devices") or []
    if not isinstance(devices, list):
        raise DecodeError("spec.devices: expected an array")
    if spec.get("sharedCounters") is not None and spec.get("devices") is not None:
        errs.append(_invalid("spec", "", "only one of `sharedCounters` or `devices` is allowed"))
    errs.extend(_counter_set_errors(spec.get("sharedCounters") or []))
    advanced = any(d.get("taints") or d.get("consumesCounters") for d in devices
                   if isinstance(d, dict))
    limit = MAX_DEVICES_ADVANCED if advanced else MAX_DEVICES
    if len(devices) > limit:
        errs.append(FieldError("FieldValueTooMany", "spec.devices",
                               f"{len(devices)}: must have at most {limit} items"))
        return errs
    old_devices = {d.get("name"): d for d in old_spec.get("devices") or []}
    seen = set()
    for i, device in enumerate(devices):
        if not isinstance(device, dict):
            raise DecodeError(f"spec.devices[{i}]: expected an object")
        errs.extend(_device_errors(device, old_devices.get(device.get("name")),
                                   f"spec.devices[{i}]"))
    for i, device in enumerate(devices):
        name = device.get("name")
        if name in seen:
            errs.append(FieldError("FieldValueDuplicate", f"spec.devices[{i}]", "", name))
        seen.add(name)
    return errs
