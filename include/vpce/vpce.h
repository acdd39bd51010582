// vpce/vpce.h: everything a C++ caller of vpce needs, in one include.
#pragma once

#include "vpce/communicator.h"  // IWYU pragma: export
#include "vpce/head.h"          // IWYU pragma: export
#include "vpce/loss.h"          // IWYU pragma: export
#include "vpce/options.h"       // IWYU pragma: export
#include "vpce/rl.h"            // IWYU pragma: export
#include "vpce/rows.h"          // IWYU pragma: export
#include "vpce/status.h"        // IWYU pragma: export
#include "vpce/tensor.h"        // IWYU pragma: export
#include "vpce/threads.h"       // IWYU pragma: export
#include "vpce/version.h"       // IWYU pragma: export
#include "vpce/workspace.h"     // IWYU pragma: export
