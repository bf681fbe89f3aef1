@0xfa9e2c71f65a8aa9;
# What every feos interface shares: the status every result carries, and small values.

enum Code {
  # The status codes, numbered as feos.errors.Code (gRPC's numbering), so a control plane maps
  # them one to one.
  ok @0;
  cancelled @1;
  unknown @2;
  invalidArgument @3;
  deadlineExceeded @4;
  notFound @5;
  alreadyExists @6;
  permissionDenied @7;
  resourceExhausted @8;
  failedPrecondition @9;
  aborted @10;
  outOfRange @11;
  unimplemented @12;
  internal @13;
  unavailable @14;
  dataLoss @15;
  unauthenticated @16;
}

struct VmBusy {
  # The busy marker: the microVM is being suspended or its VMM still writes a late snapshot. The
  # call changed nothing; ask again later. Its presence, not its content, is the marker.
}

struct Status {
  # Every method's results start with a status. code = ok (the default of an unset status) means
  # the call succeeded and the other results hold its answer; any other code means it failed, the
  # other results are unset, and message says why for people.
  code @0 :Code;
  message @1 :Text;
  vmBusy @2 :VmBusy;
  # Set only with code = unavailable: the VM is busy (see VmBusy).
}

struct Label {
  key @0 :Text;
  value @1 :Text;
}

struct Empty {}
