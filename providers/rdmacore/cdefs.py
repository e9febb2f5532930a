"""The C declarations of libibverbs and librdmacm the rdma-core backend uses (cffi ABI mode).

Only what the backend calls or reads is declared, but every declared struct is
complete, so sizes and offsets match the C compiler's (``tests/test_rdmacore_layout.py``
compares them with the installed headers). C enums are declared as ``int``, the
size the compiler gives them. ``pthread_mutex_t``/``pthread_cond_t`` appear only
as opaque members of the structs libibverbs allocates; their glibc sizes depend
on the CPU architecture.

The four "static inline" verbs of ``<infiniband/verbs.h>`` (``ibv_post_send``,
``ibv_post_recv``, ``ibv_poll_cq``, ``ibv_req_notify_cq``) are not exported by
the library; the backend calls them through ``struct ibv_context_ops``, the
table of the provider's functions inside every ``struct ibv_context``.
"""

from __future__ import annotations

import platform
from typing import Any

import cffi

_PTHREAD_MUTEX_SIZE = {"aarch64": 48, "arm64": 48}.get(platform.machine(), 40)
_PTHREAD_COND_SIZE = 48

PTHREAD = f"""
typedef union {{ char __size[{_PTHREAD_MUTEX_SIZE}]; long __align; }} pthread_mutex_t;
typedef union {{ char __size[{_PTHREAD_COND_SIZE}]; long long __align; }} pthread_cond_t;
"""

SOCKETS = """
struct sockaddr { unsigned short sa_family; char sa_data[14]; };
struct sockaddr_storage {
    unsigned short ss_family;
    char __ss_padding[118];
    unsigned long __ss_align;
};
"""

VERBS = """
union ibv_gid {
    uint8_t raw[16];
    struct { uint64_t subnet_prefix; uint64_t interface_id; } global;
};

struct _ibv_device_ops { void *_dummy1; void *_dummy2; };

struct ibv_device {
    struct _ibv_device_ops _ops;
    int node_type;
    int transport_type;
    char name[64];
    char dev_name[64];
    char dev_path[256];
    char ibdev_path[256];
};

struct ibv_context;
struct ibv_cq;
struct ibv_qp;
struct ibv_srq;
struct ibv_pd;
struct ibv_wc;
struct ibv_send_wr;
struct ibv_recv_wr;

struct ibv_context_ops {
    void *_compat_query_device;
    void *_compat_query_port;
    void *_compat_alloc_pd;
    void *_compat_dealloc_pd;
    void *_compat_reg_mr;
    void *_compat_rereg_mr;
    void *_compat_dereg_mr;
    void *alloc_mw;
    void *bind_mw;
    void *dealloc_mw;
    void *_compat_create_cq;
    int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
    int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
    void *_compat_cq_event;
    void *_compat_resize_cq;
    void *_compat_destroy_cq;
    void *_compat_create_srq;
    void *_compat_modify_srq;
    void *_compat_query_srq;
    void *_compat_destroy_srq;
    int (*post_srq_recv)(struct ibv_srq *srq, struct ibv_recv_wr *recv_wr,
                         struct ibv_recv_wr **bad_recv_wr);
    void *_compat_create_qp;
    void *_compat_query_qp;
    void *_compat_modify_qp;
    void *_compat_destroy_qp;
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
    int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
    void *_compat_create_ah;
    void *_compat_destroy_ah;
    void *_compat_attach_mcast;
    void *_compat_detach_mcast;
    void *_compat_async_event;
};

struct ibv_context {
    struct ibv_device *device;
    struct ibv_context_ops ops;
    int cmd_fd;
    int async_fd;
    int num_comp_vectors;
    pthread_mutex_t mutex;
    void *abi_compat;
};

struct ibv_device_attr {
    char fw_ver[64];
    uint64_t node_guid;
    uint64_t sys_image_guid;
    uint64_t max_mr_size;
    uint64_t page_size_cap;
    uint32_t vendor_id;
    uint32_t vendor_part_id;
    uint32_t hw_ver;
    int max_qp;
    int max_qp_wr;
    unsigned int device_cap_flags;
    int max_sge;
    int max_sge_rd;
    int max_cq;
    int max_cqe;
    int max_mr;
    int max_pd;
    int max_qp_rd_atom;
    int max_ee_rd_atom;
    int max_res_rd_atom;
    int max_qp_init_rd_atom;
    int max_ee_init_rd_atom;
    int atomic_cap;
    int max_ee;
    int max_rdd;
    int max_mw;
    int max_raw_ipv6_qp;
    int max_raw_ethy_qp;
    int max_mcast_grp;
    int max_mcast_qp_attach;
    int max_total_mcast_qp_attach;
    int max_ah;
    int max_fmr;
    int max_map_per_fmr;
    int max_srq;
    int max_srq_wr;
    int max_srq_sge;
    uint16_t max_pkeys;
    uint8_t local_ca_ack_delay;
    uint8_t phys_port_cnt;
};

struct ibv_port_attr {
    int state;
    int max_mtu;
    int active_mtu;
    int gid_tbl_len;
    uint32_t port_cap_flags;
    uint32_t max_msg_sz;
    uint32_t bad_pkey_cntr;
    uint32_t qkey_viol_cntr;
    uint16_t pkey_tbl_len;
    uint16_t lid;
    uint16_t sm_lid;
    uint8_t lmc;
    uint8_t max_vl_num;
    uint8_t sm_sl;
    uint8_t subnet_timeout;
    uint8_t init_type_reply;
    uint8_t active_width;
    uint8_t active_speed;
    uint8_t phys_state;
    uint8_t link_layer;
    uint8_t flags;
    uint16_t port_cap_flags2;
};

struct ibv_async_event {
    union { struct ibv_cq *cq; struct ibv_qp *qp; struct ibv_srq *srq; void *wq;
            int port_num; } element;
    int event_type;
};

struct ibv_wc {
    uint64_t wr_id;
    int status;
    int opcode;
    uint32_t vendor_err;
    uint32_t byte_len;
    union { uint32_t imm_data; uint32_t invalidated_rkey; };
    uint32_t qp_num;
    uint32_t src_qp;
    unsigned int wc_flags;
    uint16_t pkey_index;
    uint16_t slid;
    uint8_t sl;
    uint8_t dlid_path_bits;
};

struct ibv_pd {
    struct ibv_context *context;
    uint32_t handle;
};

struct ibv_mr {
    struct ibv_context *context;
    struct ibv_pd *pd;
    void *addr;
    size_t length;
    uint32_t handle;
    uint32_t lkey;
    uint32_t rkey;
};

struct ibv_global_route {
    union ibv_gid dgid;
    uint32_t flow_label;
    uint8_t sgid_index;
    uint8_t hop_limit;
    uint8_t traffic_class;
};

struct ibv_ah_attr {
    struct ibv_global_route grh;
    uint16_t dlid;
    uint8_t sl;
    uint8_t src_path_bits;
    uint8_t static_rate;
    uint8_t is_global;
    uint8_t port_num;
};

struct ibv_ah {
    struct ibv_context *context;
    struct ibv_pd *pd;
    uint32_t handle;
};

struct ibv_srq_attr {
    uint32_t max_wr;
    uint32_t max_sge;
    uint32_t srq_limit;
};

struct ibv_srq_init_attr {
    void *srq_context;
    struct ibv_srq_attr attr;
};

struct ibv_qp_cap {
    uint32_t max_send_wr;
    uint32_t max_recv_wr;
    uint32_t max_send_sge;
    uint32_t max_recv_sge;
    uint32_t max_inline_data;
};

struct ibv_qp_init_attr {
    void *qp_context;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    struct ibv_qp_cap cap;
    int qp_type;
    int sq_sig_all;
};

struct ibv_qp_attr {
    int qp_state;
    int cur_qp_state;
    int path_mtu;
    int path_mig_state;
    uint32_t qkey;
    uint32_t rq_psn;
    uint32_t sq_psn;
    uint32_t dest_qp_num;
    unsigned int qp_access_flags;
    struct ibv_qp_cap cap;
    struct ibv_ah_attr ah_attr;
    struct ibv_ah_attr alt_ah_attr;
    uint16_t pkey_index;
    uint16_t alt_pkey_index;
    uint8_t en_sqd_async_notify;
    uint8_t sq_draining;
    uint8_t max_rd_atomic;
    uint8_t max_dest_rd_atomic;
    uint8_t min_rnr_timer;
    uint8_t port_num;
    uint8_t timeout;
    uint8_t retry_cnt;
    uint8_t rnr_retry;
    uint8_t alt_port_num;
    uint8_t alt_timeout;
    uint32_t rate_limit;
};

struct ibv_sge {
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
};

struct ibv_mw_bind_info {
    void *mr;
    uint64_t addr;
    uint64_t length;
    unsigned int mw_access_flags;
};

struct ibv_send_wr {
    uint64_t wr_id;
    struct ibv_send_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
    int opcode;
    unsigned int send_flags;
    union { uint32_t imm_data; uint32_t invalidate_rkey; };
    union {
        struct { uint64_t remote_addr; uint32_t rkey; } rdma;
        struct { uint64_t remote_addr; uint64_t compare_add; uint64_t swap; uint32_t rkey; } atomic;
        struct { void *ah; uint32_t remote_qpn; uint32_t remote_qkey; } ud;
    } wr;
    union { struct { uint32_t remote_srqn; } xrc; } qp_type;
    union {
        struct { void *mw; uint32_t rkey; struct ibv_mw_bind_info bind_info; } bind_mw;
        struct { void *hdr; uint16_t hdr_sz; uint16_t mss; } tso;
    };
};

struct ibv_recv_wr {
    uint64_t wr_id;
    struct ibv_recv_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
};

struct ibv_srq {
    struct ibv_context *context;
    void *srq_context;
    struct ibv_pd *pd;
    uint32_t handle;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t events_completed;
};

struct ibv_qp {
    struct ibv_context *context;
    void *qp_context;
    struct ibv_pd *pd;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    uint32_t handle;
    uint32_t qp_num;
    int state;
    int qp_type;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t events_completed;
};

struct ibv_comp_channel {
    struct ibv_context *context;
    int fd;
    int refcnt;
};

struct ibv_cq {
    struct ibv_context *context;
    struct ibv_comp_channel *channel;
    void *cq_context;
    uint32_t handle;
    int cqe;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t comp_events_completed;
    uint32_t async_events_completed;
};

struct ibv_device **ibv_get_device_list(int *num_devices);
void ibv_free_device_list(struct ibv_device **list);
uint64_t ibv_get_device_guid(struct ibv_device *device);
struct ibv_context *ibv_open_device(struct ibv_device *device);
int ibv_close_device(struct ibv_context *context);
int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *device_attr);
int ibv_query_port(struct ibv_context *context, uint8_t port_num, struct ibv_port_attr *port_attr);
int ibv_get_async_event(struct ibv_context *context, struct ibv_async_event *event);
void ibv_ack_async_event(struct ibv_async_event *event);
struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);
int ibv_dealloc_pd(struct ibv_pd *pd);
struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access);
struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
                              int access);
int ibv_dereg_mr(struct ibv_mr *mr);
struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context);
int ibv_destroy_comp_channel(struct ibv_comp_channel *channel);
struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                             struct ibv_comp_channel *channel, int comp_vector);
int ibv_destroy_cq(struct ibv_cq *cq);
int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context);
void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents);
struct ibv_srq *ibv_create_srq(struct ibv_pd *pd, struct ibv_srq_init_attr *srq_init_attr);
int ibv_destroy_srq(struct ibv_srq *srq);
struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
                 struct ibv_qp_init_attr *init_attr);
int ibv_destroy_qp(struct ibv_qp *qp);
struct ibv_ah *ibv_create_ah(struct ibv_pd *pd, struct ibv_ah_attr *attr);
int ibv_destroy_ah(struct ibv_ah *ah);
int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid);
"""

RDMACM = """
struct ibv_sa_path_rec;

struct rdma_ib_addr {
    union ibv_gid sgid;
    union ibv_gid dgid;
    uint16_t pkey;
};

struct rdma_addr {
    union { struct sockaddr src_addr; struct sockaddr_storage src_storage; };
    union { struct sockaddr dst_addr; struct sockaddr_storage dst_storage; };
    union { struct rdma_ib_addr ibaddr; } addr;
};

struct rdma_route {
    struct rdma_addr addr;
    struct ibv_sa_path_rec *path_rec;
    int num_paths;
};

struct rdma_event_channel {
    int fd;
};

struct rdma_cm_event;

struct rdma_cm_id {
    struct ibv_context *verbs;
    struct rdma_event_channel *channel;
    void *context;
    struct ibv_qp *qp;
    struct rdma_route route;
    int ps;
    uint8_t port_num;
    struct rdma_cm_event *event;
    struct ibv_comp_channel *send_cq_channel;
    struct ibv_cq *send_cq;
    struct ibv_comp_channel *recv_cq_channel;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    struct ibv_pd *pd;
    int qp_type;
};

struct rdma_conn_param {
    const void *private_data;
    uint8_t private_data_len;
    uint8_t responder_resources;
    uint8_t initiator_depth;
    uint8_t flow_control;
    uint8_t retry_count;
    uint8_t rnr_retry_count;
    uint8_t srq;
    uint32_t qp_num;
};

struct rdma_ud_param {
    const void *private_data;
    uint8_t private_data_len;
    struct ibv_ah_attr ah_attr;
    uint32_t qp_num;
    uint32_t qkey;
};

struct rdma_cm_event {
    struct rdma_cm_id *id;
    struct rdma_cm_id *listen_id;
    int event;
    int status;
    union { struct rdma_conn_param conn; struct rdma_ud_param ud; } param;
};

struct ibv_context **rdma_get_devices(int *num_devices);
void rdma_free_devices(struct ibv_context **list);
struct rdma_event_channel *rdma_create_event_channel(void);
void rdma_destroy_event_channel(struct rdma_event_channel *channel);
int rdma_create_id(struct rdma_event_channel *channel, struct rdma_cm_id **id, void *context,
                   int ps);
int rdma_destroy_id(struct rdma_cm_id *id);
int rdma_bind_addr(struct rdma_cm_id *id, struct sockaddr *addr);
int rdma_resolve_addr(struct rdma_cm_id *id, struct sockaddr *src_addr,
                      struct sockaddr *dst_addr, int timeout_ms);
int rdma_resolve_route(struct rdma_cm_id *id, int timeout_ms);
int rdma_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
int rdma_connect(struct rdma_cm_id *id, struct rdma_conn_param *conn_param);
int rdma_listen(struct rdma_cm_id *id, int backlog);
int rdma_accept(struct rdma_cm_id *id, struct rdma_conn_param *conn_param);
int rdma_reject(struct rdma_cm_id *id, const void *private_data, uint8_t private_data_len);
int rdma_disconnect(struct rdma_cm_id *id);
const char *rdma_reject_msg(struct rdma_cm_id *id, int reason);
int rdma_get_cm_event(struct rdma_event_channel *channel, struct rdma_cm_event **event);
int rdma_ack_cm_event(struct rdma_cm_event *event);
"""

ffi: Any = cffi.FFI()
"""Typed Any on purpose: the C objects it makes have the fields of the declarations
above, which no static type describes."""
ffi.cdef(PTHREAD + SOCKETS + VERBS + RDMACM)
