// Stub (see README.md): cuBLASLt's handle type, opaque.
#pragma once
#include "cublas_v2.h"
typedef struct cublasLtContext* cublasLtHandle_t;
