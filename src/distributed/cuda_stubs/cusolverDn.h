// Stub (see README.md): cuSOLVER's dense handle type, opaque.
#pragma once
#include "cusolver_common.h"
typedef struct cusolverDnContext* cusolverDnHandle_t;
