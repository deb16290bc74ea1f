// Stub (see README.md): cuSOLVER's status type.
#pragma once
typedef enum { CUSOLVER_STATUS_SUCCESS = 0 } cusolverStatus_t;
