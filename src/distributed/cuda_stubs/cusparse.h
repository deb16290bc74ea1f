// Stub (see README.md): cuSPARSE's handle and status types, opaque.
#pragma once
typedef struct cusparseContext* cusparseHandle_t;
typedef enum { CUSPARSE_STATUS_SUCCESS = 0 } cusparseStatus_t;
