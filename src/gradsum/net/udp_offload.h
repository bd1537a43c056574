/* UDP segmentation offloads for the C extensions (the switch's native loop, dataplane/_pool.c,
 * and the worker's pump, net/_pump.c): one sendmsg hands the kernel several datagrams of one
 * size (GSO, UDP_SEGMENT), and one recvmsg may return several of one sender (GRO, UDP_GRO). On
 * the wire each stays its own datagram. */
#ifndef GRADSUM_UDP_OFFLOAD_H
#define GRADSUM_UDP_OFFLOAD_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103 /* Linux 4.18 */
#endif
#ifndef UDP_GRO
#define UDP_GRO 104 /* Linux 5.0 */
#endif

#define GS_MAX_GSO_BYTES 65507 /* one UDP send: 64 KiB less the IPv4 and UDP headers */

/* Room for a message's UDP_SEGMENT control message. */
union gs_segment_control {
    char buf[CMSG_SPACE(sizeof(uint16_t))];
    struct cmsghdr align;
};

/* Ask the kernel to cut `message`'s bytes into datagrams of `size` (the last may be shorter). */
static inline void gs_set_segments(struct msghdr *message, union gs_segment_control *control,
                                   uint16_t size) {
    message->msg_control = control->buf;
    message->msg_controllen = sizeof control->buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(message);
    c->cmsg_level = SOL_UDP, c->cmsg_type = UDP_SEGMENT;
    c->cmsg_len = CMSG_LEN(sizeof size);
    memcpy(CMSG_DATA(c), &size, sizeof size);
}

/* Room for the UDP_GRO control message of a read. */
union gs_gro_control {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
};

/* The size of each datagram UDP_GRO joined into this read (its control message), or all of it. */
static inline size_t gs_gro_segment(struct msghdr *message, size_t total) {
    for (struct cmsghdr *c = CMSG_FIRSTHDR(message); c != NULL; c = CMSG_NXTHDR(message, c)) {
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
            int size;
            memcpy(&size, CMSG_DATA(c), sizeof size);
            if (size > 0 && (size_t)size < total) return (size_t)size;
        }
    }
    return total;
}

/* Whether a failed GSO send means the kernel or device refuses GSO (send one by one then). */
static inline int gs_gso_refused(int error) {
    return error == EINVAL || error == EIO || error == ENOPROTOOPT || error == EOPNOTSUPP ||
           error == EMSGSIZE;
}

#endif
