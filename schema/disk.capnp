@0xd41c7a9b3e05f812;
# diskd's API on <disk-state-dir>/diskd.sock (docs/disk.md): the pods' and the volumes' disks as
# stacks of content-addressed read-only layers under a writable top of the disk's own, and the
# layers' way to and from the object store. feosd is its one client in production; diskctl looks.

using Common = import "common.capnp";

enum DiskKind {
  pod @0;      # a pod's data disk: made on a guest's blank data volume (its L0) or a baked layer
  volume @1;   # a volume: made on the volumes' empty L0, outlives the pods it is attached to
}

enum DiskState {
  stopped @0;  # no VMM may open it; nothing of it runs
  started @1;  # served: `path` is what the VMM opens, in `format`
}

enum Format {
  qcow2 @0;    # the top of a qcow2 backing chain the VMM opens itself (QEMU)
  raw @1;      # a raw file: the chain exported by a data-path process (Firecracker opens raw only)
}

struct Layer {
  digest @0 :Text;         # "sha256:<64 hex>" of the layer's file, as stored
  parent @1 :Text;         # the layer beneath it; "" for an L0
  sizeBytes @2 :UInt64;    # the layer file's bytes (what a push moves)
  virtualBytes @3 :UInt64; # the size of the disk it describes
  guest @4 :Text;          # the guest version it is made for; "" for the volumes' empty L0
  image @5 :Text;          # the image reference baked into it; "" for an L0
  pushed @6 :Bool;         # its manifest and chunks are in the object store
  disks @7 :UInt32;        # disks whose stack holds it (a layer with disks is never collected)
  createdUnixNs @8 :Int64;
}

struct Disk {
  id @0 :Text;             # a pod's ID or a volume's UUID (one namespace: they cannot collide)
  kind @1 :DiskKind;
  sizeBytes @2 :UInt64;    # what the VMM sees
  base @3 :Text;           # the digest of the layer right under the top; "" for a disk taken
                           # over from a plain file (its top is that file, raw, with no layers)
  layers @4 :List(Text);   # the whole stack beneath the top, nearest first
  state @5 :DiskState;
  path @6 :Text;           # while started: the file the VMM opens
  format @7 :Format;       # of path
  ownerUid @8 :UInt32;     # while started: the user the VMM runs as, who may open path
  allocatedBytes @9 :UInt64; # the top's own blocks (a new disk's are a few KiB: no copy)
  vmm @10 :Text;           # while started: "qemu" or "firecracker"
  dataPathPid @11 :UInt32; # while started raw: the process that serves it (0 when the VMM
                           # opens the chain itself)
  chain @12 :List(Text);   # while started qcow2: the files of the layers beneath path, nearest
                           # first; path's backing names are their file names, so a VMM that
                           # links path elsewhere (a chroot) links these beside it
}

struct StoreInfo {
  configured @0 :Bool;     # false: no bucket; push, pull and baking say why they cannot
  bucket @1 :Text;
  endpoint @2 :Text;       # "" for AWS's own
  reason @3 :Text;         # why not configured, for people
}

struct CacheInfo {
  limitBytes @0 :UInt64;   # the chunk cache's size limit (--cache-size)
  usedBytes @1 :UInt64;
  chunks @2 :UInt32;
  evictedChunks @3 :UInt64; # since diskd started
}

struct DiskdInfo {
  version @0 :Text;
  pid @1 :UInt32;
  stateDir @2 :Text;
  store @3 :StoreInfo;
  cache @4 :CacheInfo;
  ublk @5 :Text;           # "available" or why the ublk data path cannot run here
}

struct MemorySnapshot {
  digest @0 :Text;         # "sha256:<64 hex>" of the snapshot file: its name in the store
  sizeBytes @1 :UInt64;
  chunks @2 :UInt32;       # of CHUNK_SIZE (4 MiB) each, the last one shorter
  storedChunks @3 :UInt32; # chunks holding data (chunks of zeroes are not stored)
}

struct MemoryTransfer {
  id @0 :Text;             # the caller's name for it (a pod's ID)
  direction @1 :Text;      # "push" or "pull"
  bytesDone @2 :UInt64;    # of the file read and in the store (push), or written (pull)
  bytesTotal @3 :UInt64;   # the file's size (0 until the push has opened it or the pull has
                           # its manifest)
}

struct MemoryServer {
  id @0 :Text;             # the pod's ID
  digest @1 :Text;         # the memory snapshot it serves
  socket @2 :Text;         # memory.sock, where the VMM connects (gone once it has)
  state @3 :Text;          # "listening", "serving", "filled" (every page in), "ended" (its
                           # VMM ended), "failed" (its VMM killed: see reason)
  reason @4 :Text;
  vmmPid @5 :UInt32;
  sizeBytes @6 :UInt64;    # the snapshot's
  pagesIn @7 :UInt64;      # pages diskd copied (or zeroed) into the VMM
  pagesTotal @8 :UInt64;   # the VMM's guest memory in pages (4 KiB)
  faults @9 :UInt64;       # page faults served
  recovered @10 :Bool;     # taken over from the diskd before (after a restart)
}

interface DiskService {
  info @0 () -> (status :Common.Status, info :DiskdInfo);

  importLayer @1 (path :Text, guest :Text) -> (status :Common.Status, layer :Layer);
  # An L0 from a guest version's blank data volume (path: its data.img.zst, or a raw image).
  # Idempotent: the same file gives the same layer. INVALID_ARGUMENT: path is not such a file.

  createDisk @2 (id :Text, kind :DiskKind, sizeBytes :UInt64, base :Text)
      -> (status :Common.Status, disk :Disk);
  # A new disk: an empty top on the layer `base` (a digest diskd has; "": the volumes' empty
  # L0), grown to sizeBytes when that is larger than the base. No data is copied. A create that
  # comes again (the same ID, kind and base) answers the disk as it is; ALREADY_EXISTS: a disk
  # with the ID exists of another kind or base; NOT_FOUND: no such layer; INVALID_ARGUMENT: a
  # bad ID, digest or size.

  adoptDisk @3 (id :Text, kind :DiskKind, path :Text) -> (status :Common.Status, disk :Disk);
  # Take over a plain raw file made before diskd (a pod's <state>/disk/pods/<id>.img, a volume's
  # <state>/volumes/<id>.disk): moved into diskd's directory on the same filesystem, never copied
  # nor lost. Idempotent: a disk already adopted answers as it is.

  startDisk @4 (id :Text, vmm :Text, ownerUid :UInt32) -> (status :Common.Status, disk :Disk);
  # Serve the disk to a VMM ("qemu" or "firecracker") that runs as ownerUid. Started already for
  # the same VMM and user: answers as it is. FAILED_PRECONDITION: started for another.

  stopDisk @5 (id :Text) -> (status :Common.Status, disk :Disk);
  # Its data path flushed to stable storage and ended. Stopped already: answers as it is.

  deleteDisk @6 (id :Text) -> (status :Common.Status);
  # Stops it first. NOT_FOUND answers nothing else: a delete that comes again is harmless.

  getDisk @7 (id :Text) -> (status :Common.Status, disk :Disk);
  listDisks @8 () -> (status :Common.Status, disks :List(Disk));
  listLayers @9 () -> (status :Common.Status, layers :List(Layer));

  bake @10 (id :Text, image :Text) -> (status :Common.Status, layer :Layer);
  # Seal the disk's top as a read-only layer on its base (the pod's filesystem frozen by the
  # caller): the disk goes on on its own top, the layer is shared by the disks made on it next.

  push @11 (digest :Text) -> (status :Common.Status, layer :Layer);
  # The layer and the layers beneath it into the object store (chunks, then the manifest; three
  # tries each, then the store's own message). FAILED_PRECONDITION: no object store.

  pull @12 (digest :Text) -> (status :Common.Status, layer :Layer);
  # The layer (and those beneath it that diskd lacks) from the object store, every chunk checked
  # against its digest. Has it already: answers at once. NOT_FOUND: the store has no such layer.

  collect @13 () -> (status :Common.Status, layersRemoved :UInt32, chunksEvicted :UInt32,
                     bytesFreed :UInt64);
  # Garbage collection now: layers no disk stands on (but the empty L0 and the L0s of installed
  # guests), children before parents, and cached chunks of no layer. Only when asked: a layer
  # baked and not pushed yet would otherwise go with the last disk on it (docs/disk.md).

  pushMemory @14 (id :Text, path :Text) -> (status :Common.Status, memory :MemorySnapshot);
  # A memory snapshot file (a VMM's, read by diskd) into the object store as chunks, then its
  # manifest, named by the file's digest; id names the transfer (memoryTransfer,
  # abandonMemory). FAILED_PRECONDITION: no object store; ALREADY_EXISTS: a transfer of that id
  # runs; ABORTED: abandoned (or the call cancelled) before the manifest was put: none is;
  # UNAVAILABLE: the store refused after its tries, with its words.

  pullMemory @15 (id :Text, digest :Text, path :Text, ownerUid :UInt32)
      -> (status :Common.Status, memory :MemorySnapshot);
  # The snapshot whole into the file path (0600, ownerUid's; its directory must exist), every
  # chunk and the whole checked: the file appears by a rename, whole or not at all.
  # NOT_FOUND: the store has no such snapshot; DATA_LOSS: a chunk missing or not matching its
  # digest after its tries, or a damaged manifest; ABORTED, ALREADY_EXISTS as pushMemory.

  memoryTransfer @16 (id :Text) -> (status :Common.Status, transfer :MemoryTransfer);
  # The progress of the push or pull of that id in flight. NOT_FOUND: none runs.

  abandonMemory @17 (id :Text) -> (status :Common.Status);
  # The push or pull of that id ends with ABORTED at its next chunk; no manifest, no file.
  # NOT_FOUND: none runs.

  putCheckpoint @18 (body :Data) -> (status :Common.Status, ref :Text);
  # A checkpoint's description (feosd's JSON) into the object store under its digest, the
  # checkpoint's reference ("sha256:<hex>"): put last, it is a hibernation's commit point.
  getCheckpoint @19 (ref :Text) -> (status :Common.Status, body :Data);
  # NOT_FOUND: the store has none; DATA_LOSS: what it has is not `ref`'s bytes.

  abort @20 (digest :Text) -> (status :Common.Status, aborted :UInt32);
  # The layer pushes in flight of `digest` end with ABORTED (a hibernation abandoned); how
  # many there were.

  serveMemory @21 (id :Text, digest :Text, socket :Text, ownerUid :UInt32)
      -> (status :Common.Status, server :MemoryServer);
  # Listen on socket (a Unix socket made there, ownerUid's, 0600) for a VMM restoring with
  # Firecracker's Uffd memory backend, and serve it the snapshot's pages as it faults them,
  # from the chunk cache and the object store. Answers once listening; the same call again
  # answers the server as it is. NOT_FOUND: the store has no such snapshot; ALREADY_EXISTS:
  # memory of that id is served from another snapshot or socket.

  fillMemory @22 (id :Text) -> (status :Common.Status, server :MemoryServer);
  # Every page the VMM still lacks copied in; answers when its memory is whole ("filled"):
  # what the first suspend after such a restore calls before its snapshot. FAILED_PRECONDITION:
  # no VMM is connected or it ended; ABORTED: it ended meanwhile.

  getMemoryServer @23 (id :Text) -> (status :Common.Status, server :MemoryServer);
  # NOT_FOUND: diskd serves no memory of that id (a failed one is kept, with its reason, until
  # stopMemory).

  stopMemory @24 (id :Text) -> (status :Common.Status);
  # Serving ends and the server is forgotten (the VMM ended, or its owner ends it now: a VMM
  # that faults afterwards waits forever). NOT_FOUND: none.
}
