"""NVIDIA's XID catalog as data: every XID the driver documents, what it means, and what Trainyard does.

Each row is (xid, action, health, description). The action and health are Trainyard's default policy; a
site overrides rows with a policy file (policy.py). Rows follow NVIDIA's XID error documentation (the
"possible causes" and recommended recovery of each XID) as of the R535-R570 drivers. Numbers the catalog
marks unused or reserved are left out: an XID missing here is handled as `UNKNOWN_XID` (degraded, restart
the job). Entries above 125 come from the newest catalogs (Hopper/Blackwell); check them against the
documentation of the driver a site runs.

How the defaults were chosen:
- application errors (the user's program faulted: 13, 31, 43, 45, 68, 109) and engines training never
  uses (display, video encode/decode, JPEG, OFA, test messages): ignore, the GPU stays healthy. A job that
  caused one fails by itself and its restart policy applies;
- driver or transient errors that may be the software's fault (push buffer, semaphore, copy engine):
  restart the job, GPU degraded (still schedulable, last choice);
- faults of the GPU itself (ECC double-bit, uncontained ECC, micro-controller halt, GSP, NVLink): reset
  the GPU, unhealthy (the node's other GPUs keep working);
- faults that a reset cannot repair (row remapping failed, power, unstable memory interface): drain the
  node for repair; faults that need the host restarted (fallen off the bus, initialisation failure):
  reboot the host.
"""

from __future__ import annotations

from ..model import Action, Health

_I, _R, _G, _D, _B = Action.IGNORE, Action.RESTART_JOB, Action.RESET_GPU, Action.DRAIN_NODE, Action.REBOOT_HOST
_OK, _DEG, _BAD = Health.HEALTHY, Health.DEGRADED, Health.UNHEALTHY

# The XIDs NVIDIA attributes to the application: never a reason to drain a node (a site file may not
# change that, see policy.py).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

XID_CATALOG: tuple[tuple[int, Action, Health, str], ...] = (
    (1, _R, _DEG, "invalid or corrupted push buffer stream"),
    (2, _R, _DEG, "invalid or corrupted push buffer stream"),
    (3, _R, _DEG, "invalid or corrupted push buffer stream"),
    (4, _R, _DEG, "invalid or corrupted push buffer stream, or GPU semaphore timeout"),
    (6, _R, _DEG, "invalid or corrupted push buffer stream"),
    (7, _R, _DEG, "invalid or corrupted push buffer address"),
    (8, _R, _DEG, "GPU stopped processing"),
    (9, _R, _DEG, "driver error programming the GPU"),
    (11, _R, _DEG, "invalid or corrupted push buffer stream"),
    (12, _R, _DEG, "driver error handling a GPU exception"),
    (13, _I, _OK, "graphics engine exception (application error)"),
    (16, _I, _OK, "display engine hung"),
    (18, _G, _BAD, "bus mastering disabled in PCI config space"),
    (19, _I, _OK, "display engine error"),
    (20, _I, _OK, "invalid or corrupted MPEG push buffer (video engine)"),
    (21, _I, _OK, "invalid or corrupted motion estimation push buffer (video engine)"),
    (22, _I, _OK, "invalid or corrupted video processor push buffer (video engine)"),
    (24, _R, _DEG, "GPU semaphore timeout"),
    (25, _R, _DEG, "invalid or illegal push buffer stream"),
    (26, _R, _DEG, "framebuffer timeout"),
    (27, _I, _OK, "video processor exception"),
    (28, _I, _OK, "video processor exception"),
    (29, _I, _OK, "video processor exception"),
    (30, _R, _DEG, "GPU semaphore access error"),
    (31, _I, _OK, "GPU memory page fault (application error)"),
    (32, _R, _DEG, "invalid or corrupted push buffer stream (PBDMA)"),
    (33, _G, _BAD, "internal micro-controller error"),
    (34, _I, _OK, "video processor exception"),
    (35, _I, _OK, "video processor exception"),
    (36, _I, _OK, "video processor exception"),
    (37, _G, _BAD, "driver firmware error"),
    (38, _G, _BAD, "driver firmware error"),
    (42, _I, _OK, "video processor exception"),
    (43, _I, _OK, "GPU stopped processing: the application's context was stopped (application error)"),
    (44, _G, _BAD, "graphics engine fault during context switch"),
    (45, _I, _OK, "preemptive cleanup after an earlier error (application error)"),
    (46, _R, _DEG, "GPU stopped processing"),
    (47, _I, _OK, "video processor exception"),
    (48, _G, _BAD, "double-bit ECC error"),
    (54, _D, _BAD, "auxiliary power is not connected to the GPU board"),
    (56, _I, _OK, "display engine error"),
    (57, _G, _BAD, "error programming the video memory interface"),
    (58, _D, _BAD, "unstable video memory interface detected"),
    (59, _G, _BAD, "internal micro-controller error"),
    (60, _I, _OK, "video processor exception"),
    (61, _R, _DEG, "internal micro-controller breakpoint or warning"),
    (62, _G, _BAD, "internal micro-controller halt"),
    (63, _R, _DEG, "ECC page retirement or row remapping recorded"),
    (64, _D, _BAD, "ECC page retirement or row remapping failed"),
    (65, _I, _OK, "video processor exception"),
    (66, _R, _DEG, "illegal access by the driver"),
    (67, _R, _DEG, "illegal access by the driver"),
    (68, _I, _OK, "video decoder (NVDEC0) exception (application error)"),
    (69, _R, _DEG, "graphics engine class error"),
    (70, _R, _DEG, "copy engine CE3 error"),
    (71, _R, _DEG, "copy engine CE4 error"),
    (72, _R, _DEG, "copy engine CE5 error"),
    (73, _I, _OK, "video encoder NVENC2 error"),
    (74, _G, _BAD, "NVLink error"),
    (75, _R, _DEG, "copy engine CE6 error"),
    (76, _R, _DEG, "copy engine CE7 error"),
    (77, _R, _DEG, "copy engine CE8 error"),
    (78, _I, _OK, "vGPU start error"),
    (79, _B, _BAD, "GPU has fallen off the bus"),
    (80, _R, _DEG, "corrupted data sent to the GPU"),
    (81, _I, _OK, "VGA subsystem error"),
    (82, _I, _OK, "JPEG decoder NVJPG0 error"),
    (83, _I, _OK, "video decoder NVDEC1 error"),
    (84, _I, _OK, "video decoder NVDEC2 error"),
    (85, _R, _DEG, "copy engine CE9 error"),
    (86, _I, _OK, "optical flow accelerator (OFA) exception"),
    (88, _I, _OK, "video decoder NVDEC3 error"),
    (89, _I, _OK, "video decoder NVDEC4 error"),
    (92, _I, _DEG, "high single-bit ECC error rate"),
    (93, _I, _DEG, "non-fatal violation of the provisioned InfoROM wear limit"),
    (94, _R, _DEG, "contained ECC error (the affected application was stopped)"),
    (95, _G, _BAD, "uncontained ECC error"),
    (96, _I, _OK, "video decoder NVDEC5 error"),
    (97, _I, _OK, "video decoder NVDEC6 error"),
    (98, _I, _OK, "video decoder NVDEC7 error"),
    (99, _I, _OK, "JPEG decoder NVJPG1 error"),
    (100, _I, _OK, "JPEG decoder NVJPG2 error"),
    (101, _I, _OK, "JPEG decoder NVJPG3 error"),
    (102, _I, _OK, "JPEG decoder NVJPG4 error"),
    (103, _I, _OK, "JPEG decoder NVJPG5 error"),
    (104, _I, _OK, "JPEG decoder NVJPG6 error"),
    (105, _I, _OK, "JPEG decoder NVJPG7 error"),
    (106, _I, _OK, "SMBPBI test message"),
    (107, _I, _OK, "SMBPBI test message (silent)"),
    (109, _I, _OK, "context switch timeout (application error)"),
    (110, _G, _BAD, "security fault"),
    (111, _I, _OK, "display bundle error event"),
    (112, _I, _OK, "display supervisor error"),
    (113, _I, _OK, "DisplayPort link training error"),
    (114, _I, _OK, "display pipeline underflow"),
    (115, _I, _OK, "display core channel error"),
    (116, _I, _OK, "display window channel error"),
    (117, _I, _OK, "display cursor channel error"),
    (118, _I, _OK, "display pixel pipeline error"),
    (119, _G, _BAD, "GSP RPC timeout"),
    (120, _G, _BAD, "GSP error"),
    (121, _G, _BAD, "C2C (chip-to-chip) link error"),
    (122, _I, _DEG, "SPI PMU RPC read failure"),
    (123, _I, _DEG, "SPI PMU RPC write failure"),
    (124, _I, _DEG, "SPI PMU RPC erase failure"),
    (125, _I, _DEG, "InfoROM file system failure"),
    (137, _R, _DEG, "NVLink FLA privilege error"),
    (140, _G, _BAD, "unrecovered ECC error"),
    (143, _B, _BAD, "GPU initialization failure"),
    (144, _G, _BAD, "NVLink SAW error"),
    (145, _G, _BAD, "NVLink RLW error"),
    (146, _G, _BAD, "NVLink TLW error"),
    (147, _G, _BAD, "NVLink TREX error"),
    (148, _G, _BAD, "NVLink NVLPW_CTRL error"),
    (149, _G, _BAD, "NVLink NETIR error"),
    (150, _G, _BAD, "NVLink MSE error"),
    (151, _G, _BAD, "key rotation error (confidential computing)"),
    (154, _G, _BAD, "GPU recovery action changed: the driver asks for a GPU reset, a reboot or a drain "
                    "(nvidia-smi -q shows which)"),
    (156, _R, _DEG, "resource retirement event"),
    (157, _D, _BAD, "resource retirement failure"),
    (158, _G, _BAD, "GPU fatal timeout"),
    (159, _G, _BAD, "CHI non-data error"),
    (160, _R, _DEG, "channel retirement event"),
    (161, _D, _BAD, "channel retirement failure"),
    (162, _I, _OK, "power smoothing circuitry capability re-engaged"),
    (163, _I, _OK, "power smoothing circuitry capability disengaged"),
    (164, _I, _DEG, "power smoothing circuitry reached its low-lifetime threshold"),
)

# An XID the catalog does not know: suspicious, not proven fatal.
UNKNOWN_XID = (_R, _DEG, "XID not in the catalog; see NVIDIA's XID documentation")
