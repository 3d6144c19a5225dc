// CPU probe ops (domain `ortfuse.probe`): see ofz_probe.c.
#pragma once
#include "ofz_common.h"

#define OFZ_PROBE_DOMAIN "ortfuse.probe"

// Initialises the two static probe ops (call once, under the registration lock).
void ofz_probe_ops(const OrtCustomOp** probe, const OrtCustomOp** plan);
