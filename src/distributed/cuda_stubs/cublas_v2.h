// Stub (see README.md): cuBLAS's handle and status types, opaque.
#pragma once
typedef struct cublasContext* cublasHandle_t;
typedef enum { CUBLAS_STATUS_SUCCESS = 0 } cublasStatus_t;
